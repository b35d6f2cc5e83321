"""Text from an MLX decoder: generation with a key/value cache, and held-out loss and perplexity.

The functions of edgetrain.models.generate for MLXDecoder (the MLX backend's Backend.text_out, so
`edgetrain.generate(model, ...)`, `edgetrain generate --backend mlx` and `edgetrain eval` come here),
with the same signatures, argument checks and decoding loop: greedy decoding and seeded sampling pick
the same tokens from the same logits on both frameworks.

The cached forward reuses the model's own modules (projections with their LoRA adapters or quantised
weights, norms, MLP); only attention differs: the new positions' queries attend to the kept keys and
values of every earlier position (model.causal_attention with a start offset).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
import torch

from edgetrain.backends.mlx.learner import batch_arrays
from edgetrain.backends.mlx.model import Attention, DecoderBlock, MLXDecoder
from edgetrain.data.batch import Batch
from edgetrain.data.chat_template import Message
from edgetrain.backends.mlx.token_loss import token_losses
from edgetrain.models.generate import HeldOutLoss, check_prompt, check_sampling, continue_text, decode_loop
from edgetrain.registry import EdgetrainError
from edgetrain.training.losses import IGNORE_INDEX


@dataclass
class MLXKVCache:
    """Per block, the keys and values of every position seen so far: [batch, kv_heads, positions, head_dim]."""
    keys: list[mx.array | None] = field(default_factory=list)
    values: list[mx.array | None] = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if not self.keys or self.keys[0] is None else self.keys[0].shape[2]


def _attend(attention: Attention, x: mx.array, rope: tuple[mx.array, mx.array], cache: MLXKVCache,
            index: int, start: int) -> mx.array:
    batch, steps, _ = x.shape
    q, k, v = attention.queries_keys_values(x, rope)
    if cache.keys[index] is not None:
        k = mx.concatenate([cache.keys[index], k], axis=2)
        v = mx.concatenate([cache.values[index], v], axis=2)
    cache.keys[index], cache.values[index] = k, v
    out = attention.attend(q, k, v, start)
    return attention.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, steps, -1))


def _block(block: DecoderBlock, h: mx.array, rope: tuple[mx.array, mx.array], cache: MLXKVCache, index: int,
           start: int) -> mx.array:
    h = block.attention_residual(h, _attend(block.self_attn, block.input_layernorm(h), rope, cache, index, start))
    return block.mlp_residual(h)


def _require_decoder(model: Any) -> None:
    if not isinstance(model, MLXDecoder) or getattr(model, "task", None) != "lm":
        raise EdgetrainError(f"generation needs a decoder language model (llama, qwen2, qwen3); got {type(model).__name__}")


def forward_cached(model: MLXDecoder, token_ids: mx.array, cache: MLXKVCache, *, last_only: bool = False) -> mx.array:
    """Logits of `token_ids` [batch, steps], which follow the cache's positions; the cache grows by them.
    The logits and the cache are evaluated, so that the cache never holds a growing lazy graph.
    `last_only`: the last position's logits alone [batch, 1, vocab] (what decoding reads)."""
    _require_decoder(model)
    if not cache.keys:
        cache.keys, cache.values = [None] * len(model.blocks), [None] * len(model.blocks)
    start = cache.length
    h = model.embed(token_ids)
    ropes = model.block_ropes(start + token_ids.shape[1], h.dtype, start)
    for index, (block, rope) in enumerate(zip(model.blocks, ropes)):
        h = _block(block, h, rope, cache, index, start)
    logits = model.logits(h[:, -1:] if last_only else h)
    mx.eval(logits, cache.keys, cache.values)
    return logits


def _as_torch(row: mx.array) -> torch.Tensor:
    return torch.from_numpy(np.array(row.astype(mx.float32)))


def generate_ids(model: MLXDecoder, prompt_ids: list[int], max_new_tokens: int = 64, *, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, stop_ids: Iterable[int] = (),
                 stop_sequences: Iterable[Sequence[int]] = ()) -> list[int]:
    """The ids that follow `prompt_ids`: greedy at temperature 0, else sampled (seeded) from the
    temperature-scaled distribution, cut to its top_p mass. Stops early at any of `stop_ids`, or when
    the ids end with one of `stop_sequences` (the stop is returned too)."""
    check_sampling(max_new_tokens, temperature, top_p)
    _require_decoder(model)
    check_prompt(prompt_ids, model.config.vocab_size)
    cache = MLXKVCache()

    def next_logits(ids: list[int]) -> torch.Tensor:
        return _as_torch(forward_cached(model, mx.array([ids], dtype=mx.int32), cache, last_only=True)[0, -1])

    was_training = model.training
    model.eval()  # LoRA dropout off
    try:
        return decode_loop(next_logits, prompt_ids, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                           stop_ids=stop_ids, stop_sequences=stop_sequences)
    finally:
        model.train(was_training)


def generate(model: MLXDecoder, prompt: str | Sequence[Message], max_new_tokens: int = 64, *,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, chat_template: str | None = None) -> str:
    """The text the model writes after `prompt`, tokenised with the model's own tokenizer; it stops at the
    tokenizer's end-of-sequence id when it has one. A chat `prompt` (a list of messages) is rendered with the
    model's chat template, or `chat_template`, and stops at its end of turn too (as the torch version)."""
    return continue_text(generate_ids, model, prompt, max_new_tokens, temperature=temperature, top_p=top_p,
                         seed=seed, chat_template=chat_template)


def _token_losses(model: MLXDecoder, batch: Batch) -> np.ndarray:
    """The next-token cross-entropy of every position with a target (edgetrain.backends.mlx.token_loss)."""
    inputs, targets = batch_arrays(batch)
    return token_losses(model, inputs, targets)


def held_out_loss(model: MLXDecoder, batches: Iterable[Batch] | Iterator[Batch]) -> HeldOutLoss:
    """Mean token loss of the model over `batches` (targets -100 ignored), weighted by tokens, not batches."""
    _require_decoder(model)
    was_training = model.training
    model.eval()
    total, tokens, count = 0.0, 0, 0
    try:
        for batch in batches:
            losses = _token_losses(model, batch)
            total += float(losses.sum())  # summed in float64, as the torch version's double cross-entropy
            tokens += losses.size
            count += 1
    finally:
        model.train(was_training)
    return HeldOutLoss.of_sum(total, tokens, count)
