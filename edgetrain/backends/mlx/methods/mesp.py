"""`mesp` on MLX: Memory-efficient Structured Backpropagation (Park et al.), the same hand-derived
backward as edgetrain.methods.mesp on torch:

  forward   blocks one at a time; only each block's input is kept ([B, T, D] per block).
  head      loss and dL/d(final hidden) in one pass over the LM head weight, in tiles of
            `loss_chunk` tokens x `vocab_chunk` entries: the [B, T, vocab] logits never exist.
  backward  blocks in reverse: each recomputed from its stored input and differentiated by hand
            (mesp_block.py); its gradients are evaluated (mx.eval) and handed on, its input
            dropped, and mx.clear_cache() returns the block's buffers to the system before the
            next block -- the paper's "mx.eval(gradients); GPU.clearCache()" (Appendix E.3).

fused_update applies the optimizer to each block's adapters as soon as they exist (the paper's
"update parameters immediately"), so the gradients of different blocks never coexist.
"""
from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from edgetrain.backends.mlx.lora import LoRALinear, trainable_parameters
from edgetrain.backends.mlx.methods.common import MLX_METHODS, clear_memory
from edgetrain.backends.mlx.methods.mesp_block import BlockWeights, block_backward, block_forward
from edgetrain.backends.mlx.methods.mesp_ops import compute_dtype, rms_norm_backward, rms_norm_forward
from edgetrain.backends.mlx.model import MLXDecoder
from edgetrain.methods.configs import MeSPConfig, method_config
from edgetrain.registry import EdgetrainError
from edgetrain.training.losses import IGNORE_INDEX
from edgetrain.backends.mlx.evaluation import evaluate

# The torch method's defaults (edgetrain.methods.mesp.method), for the same bounded temporaries.
DEFAULT_ATTENTION_CHUNK = MeSPConfig.attention_chunk
DEFAULT_MLP_CHUNK = MeSPConfig.mlp_chunk
DEFAULT_LOSS_CHUNK = MeSPConfig.loss_chunk
DEFAULT_VOCAB_CHUNK = 4096

BlockGradientsHook = Callable[[int, dict[str, mx.array]], None]


def chunked_lm_loss(hidden: mx.array, norm_weight: mx.array, eps: float, lm_weight: mx.array,
                    targets: mx.array, chunk: int, vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
                    soft_cap: float | None = None) -> tuple[mx.array, mx.array]:
    """Mean next-token cross-entropy of (rms_norm(hidden) @ lm_weight^T) against `targets` (-100 =
    no target) and dL/dhidden, with at most a [chunk, vocab_chunk] logits tile alive.

    As FlashAttention over the vocabulary: a running max, sum_v exp(l_v - max) and
    sum_v exp(l_v - max) W_v over the non-target entries, then
      loss = log(1 + sum_{v != t} exp(l_v - l_t)),  dL/dn = (sum_{v != t} p_v W_v - (1 - p_t) W_t) / N,
    the target's own term added exactly at the end (no cancellation when p_t ~ 1). `soft_cap`: logits
    cap * tanh(z / cap), each row weighed by the cap's slope 1 - tanh^2 (as the torch loss)."""
    if chunk < 1 or vocab_chunk < 1:
        raise ValueError(f"loss chunk sizes must be positive, got chunk={chunk}, vocab_chunk={vocab_chunk}")
    dtype, work = hidden.dtype, compute_dtype(hidden.dtype)
    dim = hidden.shape[-1]
    flat_hidden = hidden.reshape(-1, dim)
    flat_targets = targets.reshape(-1)
    valid = flat_targets != IGNORE_INDEX
    inverse_count = 1.0 / mx.sum(valid).astype(work)
    vocab_size = lm_weight.shape[0]
    loss_sum = mx.array(0.0, dtype=mx.float32)
    grad_chunks = []
    for start in range(0, flat_hidden.shape[0], chunk):
        stop = min(start + chunk, flat_hidden.shape[0])
        hidden_chunk = flat_hidden[start:stop]
        normed = rms_norm_forward(hidden_chunk, norm_weight, eps)
        chunk_valid = valid[start:stop][:, None]
        safe_targets = mx.where(chunk_valid[:, 0], flat_targets[start:stop], 0)[:, None]
        rows = stop - start
        running_max = mx.full((rows, 1), -mx.inf, dtype=work)
        target_logits = mx.zeros((rows, 1), dtype=work)
        other_exp_sum = mx.zeros((rows, 1), dtype=work)
        other_weighted_rows = mx.zeros((rows, dim), dtype=work)
        for vocab_start in range(0, vocab_size, vocab_chunk):
            weight_block = lm_weight[vocab_start:vocab_start + vocab_chunk]
            logits = (normed @ weight_block.T).astype(work)
            slopes = None
            if soft_cap is not None:
                capped = mx.tanh(logits / soft_cap)
                slopes, logits = 1 - capped * capped, capped * soft_cap
            width = logits.shape[1]
            in_tile = (safe_targets >= vocab_start) & (safe_targets < vocab_start + width)
            tile_targets = mx.clip(safe_targets - vocab_start, 0, width - 1)
            target_logits = mx.where(in_tile, mx.take_along_axis(logits, tile_targets, axis=1), target_logits)
            new_max = mx.maximum(running_max, mx.max(logits, axis=1, keepdims=True))
            rescale = mx.exp(running_max - new_max)  # 0 on the first tile (exp(-inf))
            exps = mx.exp(logits - new_max)
            is_target = (mx.arange(width)[None, :] == tile_targets) & in_tile
            exps = mx.where(is_target, 0.0, exps)
            other_exp_sum = other_exp_sum * rescale + mx.sum(exps, axis=1, keepdims=True)
            weighted = exps if slopes is None else exps * slopes
            other_weighted_rows = other_weighted_rows * rescale + weighted @ weight_block.astype(work)
            running_max = new_max
            # One tile alive at a time: without this, the lazy graph would hold every tile.
            evaluate(running_max, target_logits, other_exp_sum, other_weighted_rows)
        exp_sum = other_exp_sum + mx.exp(target_logits - running_max)
        gap = running_max - target_logits
        token_loss = mx.where(gap < 30, mx.log1p(other_exp_sum * mx.exp(mx.minimum(gap, 30))),
                              gap + mx.log(exp_sum))
        loss_sum = loss_sum + mx.sum(mx.where(chunk_valid, token_loss, 0.0)).astype(mx.float32)
        row_weight = chunk_valid.astype(work) * inverse_count
        target_rows = lm_weight[safe_targets[:, 0]].astype(work)
        if soft_cap is not None:  # the target's own slope
            target_rows = target_rows * (1 - (target_logits / soft_cap) ** 2)
        grad_normed = ((other_weighted_rows - target_rows * other_exp_sum) * (row_weight / exp_sum)).astype(dtype)
        grad_chunks.append(rms_norm_backward(hidden_chunk, norm_weight, eps, grad_normed))
        evaluate(loss_sum, grad_chunks[-1])
    grad_hidden = mx.concatenate(grad_chunks, axis=0) if len(grad_chunks) > 1 else grad_chunks[0]
    return (loss_sum * inverse_count).astype(work), grad_hidden.reshape(hidden.shape)


class StructuredBackprop:
    """The MLX `mesp` method. Its options are torch's (edgetrain.methods.configs.MeSPConfig):
    fused_update, rollback, store_lora_projection, attention_chunk, mlp_chunk, loss_chunk, vocab_chunk."""

    # Its step is its gradients and one optimizer update: the learner may accumulate and clip them.
    gradient_step = True

    name = "mesp"

    def __init__(self, model: nn.Module, **options: Any) -> None:
        config = method_config("mesp", options)  # the options torch's mesp takes too (methods/configs.py)
        if not isinstance(model, MLXDecoder):
            raise EdgetrainError(f"MLX mesp works on MLX decoders (edgetrain.backends.mlx.model.MLXDecoder), "
                                 f"not a {type(model).__name__}; use 'mebp' or 'bp' for other models")
        if config.compile_blocks:
            raise EdgetrainError("mesp: compile_blocks compiles torch's block programs (torch.compile); MLX's mesp "
                                 "has no compiled path yet: leave it off on MLX")
        self.fused_update, self.rollback = config.fused_update, config.rollback
        self.store_lora_projection = config.store_lora_projection
        self.attention_chunk, self.mlp_chunk, self.loss_chunk = config.attention_chunk, config.mlp_chunk, config.loss_chunk
        self.vocab_chunk = DEFAULT_VOCAB_CHUNK if config.vocab_chunk is None else config.vocab_chunk
        self.model = model
        params = trainable_parameters(model)
        adapters = {f"blocks.{i}.{path}.{part}" for i, block in enumerate(model.blocks)
                    for path, module in block.named_modules() if isinstance(module, LoRALinear)
                    for part in ("lora_a", "lora_b")}
        others = sorted(set(params) - adapters)
        if others:
            shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
            raise EdgetrainError(f"mesp is for LoRA fine-tuning: it computes gradients only for the LoRA "
                                 f"adapters (lora_a / lora_b) of the decoder blocks, but {shown} is trainable "
                                 "too. Freeze it, or use method 'mebp'.")
        self.names = list(params)

    @property
    def partial_updates(self) -> bool:
        # With fused_update a non-finite gradient can be found after later blocks were updated: with
        # rollback the learner keeps a snapshot to put them back (arrays are immutable: it costs nothing).
        return self.fused_update and self.rollback

    def run(self, inputs: mx.array, targets: mx.array, on_block_gradients: BlockGradientsHook) -> mx.array:
        """Forward, chunked loss and the reverse walk; calls on_block_gradients(block index,
        {model parameter name: evaluated gradient}) last block first. Returns the loss."""
        if inputs.ndim != 2 or targets.shape != inputs.shape:
            raise EdgetrainError(f"mesp: inputs must be token ids [B, T] with targets of the same shape; "
                                 f"got {tuple(inputs.shape)} and {tuple(targets.shape)}")
        model = self.model
        chunks = dict(attention_chunk=self.attention_chunk, mlp_chunk=self.mlp_chunk)
        hidden = model.embed(inputs)
        ropes = model.block_ropes(hidden.shape[1], hidden.dtype)
        mx.eval(hidden, ropes)
        weights = [BlockWeights.from_block(block, f"blocks.{i}") for i, block in enumerate(model.blocks)]
        block_inputs: list[mx.array] = []
        for block_weights, rope in zip(weights, ropes):
            block_inputs.append(hidden)
            hidden = block_forward(block_weights, hidden, rope, **chunks)
            mx.eval(hidden)
        loss, grad = chunked_lm_loss(hidden, model.head.norm.weight, model.head.norm.eps, model.lm_head_weight(),
                                     targets, self.loss_chunk, self.vocab_chunk, model.config.final_logit_softcapping)
        mx.eval(loss, grad)
        del hidden
        clear_memory()
        for index in reversed(range(len(weights))):
            block_input = block_inputs.pop()
            grad, block_grads = block_backward(weights[index], block_input, grad, ropes[index],
                                               store_lora_projection=self.store_lora_projection, **chunks)
            del block_input
            on_block_gradients(index, {f"blocks.{index}.{local}": g for local, g in block_grads.items()})
            del block_grads
            clear_memory()
        return loss

    def gradients(self, inputs: mx.array, targets: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
        collected: dict[str, mx.array] = {}
        loss = self.run(inputs, targets, lambda index, grads: collected.update(grads))
        params = trainable_parameters(self.model)
        return loss, {name: collected.get(name, mx.zeros_like(params[name])) for name in self.names}

    def step(self, inputs: mx.array, targets: mx.array, optimizer: Any) -> mx.array:
        if not self.fused_update:
            loss, grads = self.gradients(inputs, targets)
            optimizer.apply(grads)
            return loss
        # Block 0 comes last: its update is the one that counts as the optimizer's step.
        return self.run(inputs, targets, lambda index, grads: optimizer.apply(grads, advance_step=index == 0))

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


MLX_METHODS.add("mesp", StructuredBackprop)
