"""Text from a decoder: autoregressive sampling with a key/value cache, and held-out loss and perplexity.

The cache path reuses the model's own modules (projections, LoRA adapters, norms, MLP); only attention
differs, because each new token attends to the keys and values of all earlier ones, which are kept
instead of recomputed. It matches the model's full forward (tests/models/test_generate.py).

The three public functions take the models of other frameworks too: a model that is not a torch module
goes to its backend's own module (Backend.text_out; MLX: edgetrain.backends.mlx.generate), which shares
the argument checks, the decoding loop and the sampling below, and continue_text: the prompt -- a string, or
a chat rendered with the model's chat template -- and where its reply stops (edgetrain.data.chat_prompt).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from edgetrain.backends.base import text_functions_for
from edgetrain.data.batch import Batch
from edgetrain.data.chat_prompt import ends_with, generation_prompt
from edgetrain.data.chat_template import Message
from edgetrain.models.llama import Attention, DecoderBlock
from edgetrain.models.token_loss import is_block_decoder, summed_token_loss
from edgetrain.registry import EdgetrainError


@dataclass
class KVCache:
    """Per block, the keys and values of every position seen so far: [batch, kv_heads, positions, head_dim]."""
    keys: list[torch.Tensor | None] = field(default_factory=list)
    values: list[torch.Tensor | None] = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if not self.keys or self.keys[0] is None else self.keys[0].shape[2]


def attend(attention: Attention, x: torch.Tensor, cache: KVCache, index: int, start: int,
           visible: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of `x` (the positions after the cache's) over the cache and itself; the cache grows by x.
    `visible`: which keys each query sees, broadcastable to [batch, heads, steps, keys] (default causal)."""
    batch, steps, _ = x.shape
    q, k, v = attention.queries_keys_values(x, start)
    if cache.keys[index] is not None:
        k = torch.cat([cache.keys[index], k], dim=2)
        v = torch.cat([cache.values[index], v], dim=2)
    cache.keys[index], cache.values[index] = k, v
    # Query i (position start + i) sees keys 0 .. start + i, within the layer's sliding window.
    causal = attention.visible(start, steps, start + steps, x.device)
    out = attention.attend(q, k, v, causal if visible is None else visible & causal)
    return attention.o_proj(out.transpose(1, 2).reshape(batch, steps, -1))


def block_cached(block: DecoderBlock, h: torch.Tensor, cache: KVCache, index: int, start: int,
                 visible: torch.Tensor | None = None) -> torch.Tensor:
    """One decoder block over the positions after the cache's (`visible` as attend takes it)."""
    h = block.attention_residual(h, attend(block.self_attn, block.input_layernorm(h), cache, index, start, visible))
    return block.mlp_residual(h)


def _require_decoder(model: nn.Module) -> None:
    if not is_block_decoder(model):
        raise EdgetrainError(f"generation needs a decoder language model (llama, qwen2, qwen3); got {type(model).__name__}")


@torch.no_grad()
def forward_cached(model: nn.Module, token_ids: torch.Tensor, cache: KVCache, *, last_only: bool = False
                   ) -> torch.Tensor:
    """Logits of `token_ids` [batch, steps], which follow the cache's positions; the cache grows by them.
    `last_only`: the logits of the last position alone [batch, 1, vocab] (what decoding reads; a prompt's
    other positions would cost a [steps, vocab] matrix for nothing)."""
    _require_decoder(model)
    if not cache.keys:
        cache.keys, cache.values = [None] * len(model.blocks), [None] * len(model.blocks)
    start = cache.length
    h = model.embed(token_ids)
    for index, block in enumerate(model.blocks):
        h = block_cached(block, h, cache, index, start)
    return model.head(h[:, -1:] if last_only else h)


def check_sampling(max_new_tokens: int, temperature: float, top_p: float) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise EdgetrainError(f"max_new_tokens must be a whole number >= 1, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise EdgetrainError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise EdgetrainError(f"top_p must be in (0, 1], got {top_p!r}")


def check_prompt(prompt_ids: Sequence[int], vocab: int) -> None:
    if not prompt_ids:
        raise EdgetrainError("the prompt is empty: generation needs at least one token to continue from")
    bad = [i for i in prompt_ids if not 0 <= int(i) < vocab]
    if bad:
        raise EdgetrainError(f"prompt token id {bad[0]} is outside the model's vocabulary [0, {vocab})")


def _pick(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    probabilities = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p < 1:
        ordered, order = probabilities.sort(descending=True)
        keep = ordered.cumsum(0) - ordered < top_p  # the smallest head of the distribution holding top_p
        probabilities = torch.zeros_like(probabilities).scatter(0, order[keep], ordered[keep])
    return int(torch.multinomial(probabilities.cpu(), 1, generator=generator))


def decode_loop(next_logits: Callable[[list[int]], torch.Tensor], prompt_ids: Sequence[int],
                max_new_tokens: int, *, temperature: float, top_p: float, seed: int,
                stop_ids: Iterable[int], stop_sequences: Iterable[Sequence[int]] = ()) -> list[int]:
    """The decoding loop every framework shares, so that sampling means the same everywhere:
    `next_logits(ids)` feeds ids that follow all ids fed before (the prompt first) and returns the
    [vocab] logits after the last of them, as a torch tensor; tokens are picked by _pick with a torch
    generator seeded with `seed`. It stops after any of `stop_ids`, or once the ids it produced end with
    one of `stop_sequences` (both kept in what it returns)."""
    generator = torch.Generator().manual_seed(seed)
    stops = set(stop_ids)
    sequences = [list(sequence) for sequence in stop_sequences]
    logits = next_logits([int(i) for i in prompt_ids])
    produced: list[int] = []
    while True:
        token = _pick(logits, temperature, top_p, generator)
        produced.append(token)
        if token in stops or any(ends_with(produced, s) for s in sequences) or len(produced) == max_new_tokens:
            return produced
        logits = next_logits([token])


def generate_ids(model: Any, prompt_ids: list[int], max_new_tokens: int = 64, *, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, stop_ids: Iterable[int] = (),
                 stop_sequences: Iterable[Sequence[int]] = ()) -> list[int]:
    """The ids that follow `prompt_ids`: greedy at temperature 0, else sampled (seeded) from the
    temperature-scaled distribution, cut to its top_p mass. Stops early at any of `stop_ids`, or when
    the ids end with one of `stop_sequences` (the stop is returned too)."""
    if not isinstance(model, nn.Module):
        return text_functions_for(model).generate_ids(model, prompt_ids, max_new_tokens, temperature=temperature,
                                                      top_p=top_p, seed=seed, stop_ids=stop_ids,
                                                      stop_sequences=stop_sequences)
    check_sampling(max_new_tokens, temperature, top_p)
    _require_decoder(model)
    check_prompt(prompt_ids, model.config.vocab_size)
    device = next(model.parameters()).device
    cache = KVCache()
    was_training = model.training
    model.eval()
    try:
        return decode_loop(lambda ids: forward_cached(model, torch.tensor([ids], device=device), cache,
                                                      last_only=True)[0, -1],
                           prompt_ids, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                           stop_ids=stop_ids, stop_sequences=stop_sequences)
    finally:
        model.train(was_training)


def continue_text(generate_ids: Callable[..., list[int]], model: Any, prompt: str | Sequence[Message],
                  max_new_tokens: int, *, temperature: float, top_p: float, seed: int,
                  chat_template: str | None = None) -> str:
    """`prompt` through the model's own tokenizer (a chat rendered with its chat template first, see
    edgetrain.data.chat_prompt), `generate_ids`, and the new ids back to text; generation stops at the
    tokenizer's end-of-sequence id when it has one, and a chat's also at the template's end of turn (the
    stop is not part of the text)."""
    from edgetrain.data.tokenizer import model_tokenizer

    tokenizer = model_tokenizer(model)
    request = generation_prompt(tokenizer, prompt, chat_template)
    ids = generate_ids(model, request.ids, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                       stop_ids=request.stop_ids, stop_sequences=request.stop_sequences)
    return tokenizer.decode(request.reply(ids))


def generate(model: Any, prompt: str | Sequence[Message], max_new_tokens: int = 64, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, chat_template: str | None = None) -> str:
    """The text the model writes after `prompt`, tokenised with the model's own tokenizer; it stops at the
    tokenizer's end-of-sequence id when it has one.

    `prompt` may be a chat, a list of {"role", "content"} messages: it is rendered with the model's chat
    template (or `chat_template`, a Jinja string, for a tokenizer without one) ready for the assistant's
    turn, and the reply stops at the template's end of turn too (`<|im_end|>` in ChatML)."""
    if not isinstance(model, nn.Module):
        return text_functions_for(model).generate(model, prompt, max_new_tokens, temperature=temperature,
                                                  top_p=top_p, seed=seed, chat_template=chat_template)
    return continue_text(generate_ids, model, prompt, max_new_tokens, temperature=temperature, top_p=top_p,
                         seed=seed, chat_template=chat_template)


@dataclass(frozen=True)
class HeldOutLoss:
    loss: float        # mean next-token cross-entropy, nats per token
    tokens: int        # predicted tokens it averages over
    batches: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @classmethod
    def of_sum(cls, total: float, tokens: int, batches: int) -> "HeldOutLoss":
        """From the summed token losses; no tokens at all is an error (the data is too short)."""
        if tokens == 0:
            raise EdgetrainError("held-out evaluation got no tokens: the data is shorter than one sequence")
        return cls(total / tokens, tokens, batches)


@torch.no_grad()
def held_out_loss(model: Any, batches: Iterable[Batch] | Iterator[Batch]) -> HeldOutLoss:
    """Mean token loss of the model over `batches` (targets -100 ignored), weighted by tokens, not batches;
    the head reads its weight a tile of vocabulary rows at a time (edgetrain.models.token_loss)."""
    if not isinstance(model, nn.Module):
        return text_functions_for(model).held_out_loss(model, batches)
    _require_decoder(model)
    was_training = model.training
    model.eval()
    total, tokens, count = 0.0, 0, 0
    try:
        for batch in batches:
            batch_total, batch_tokens = summed_token_loss(model, batch.inputs, batch.targets)
            total += batch_total
            tokens += batch_tokens
            count += 1
    finally:
        model.train(was_training)
    return HeldOutLoss.of_sum(total, tokens, count)
