"""The LM loss over the head (final RMSNorm + LM head) and its gradient, in tiles of tokens x vocab.

With Qwen2.5's 151,936-token vocabulary the logits of 256 tokens take 156 MB in fp32, and autograd
keeps them, their log-softmax and their gradient alive together -- more than every decoder block's
activations. Here the logits only ever exist as one [chunk tokens, vocab_chunk] tile.

The LM head is attention with the vocabulary as keys *and* values: for normalised hidden n,
  loss = logsumexp(n W^T) - n . W[target],   dL/dn = (softmax(n W^T) W - W[target]) / N_valid,
so, as in FlashAttention, one pass over the vocabulary with a running max and sum accumulates both
the log-normaliser and sum_v exp(l_v - max) W_v. Each block of W is read from memory once per token
chunk and used twice while it is in cache (logits, then the gradient), which is why this is no
slower than autograd's two full matmuls despite never holding the logits.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from edgetrain.methods.mesp.ops import compute_dtype, matmul, rms_norm_backward, rms_norm_forward
from edgetrain.training.losses import IGNORE_INDEX

# Vocabulary rows per tile: a [4096, hidden] block of W (14.7 MB for Qwen2.5-0.5B in fp32) stays in a
# typical last-level cache between its two uses.
DEFAULT_VOCAB_CHUNK = 4096
# A quantised head's tile is dequantised into a scratch buffer, not a view of the weight: on a CPU a
# smaller one keeps that copy (512 x hidden) near edgetrain.models.quantized.TILE_ELEMENTS. A GPU keeps
# DEFAULT_VOCAB_CHUNK, near ACCELERATOR_TILE_ELEMENTS: there fewer tiles mean fewer kernel launches.
QUANTIZED_HEAD_VOCAB_CHUNK = 512


def default_vocab_chunk(quantized_head: bool, device: torch.device) -> int:
    """Vocabulary rows per loss tile when the option is not set: DEFAULT_VOCAB_CHUNK, or
    QUANTIZED_HEAD_VOCAB_CHUNK for a quantised head on a CPU (near the dequantised tile's size, for its cache)."""
    return QUANTIZED_HEAD_VOCAB_CHUNK if quantized_head and device.type == "cpu" else DEFAULT_VOCAB_CHUNK


def chunked_lm_loss(hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float, lm_weight: torch.Tensor | Any,
                    targets: torch.Tensor, chunk: int, vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
                    soft_cap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-token cross-entropy of lm_head(rms_norm(hidden)) against `targets` (aligned with
    the positions; IGNORE_INDEX = -100 positions carry no loss), and dL/dhidden.

    hidden [B, T, D] or [N, D]; lm_weight [vocab, D] (tied or not: it is only read), or a quantised head
    (edgetrain.models.quantized: QuantizedLinear, TiedQuantizedHead) dequantised one tile of rows at a
    time; targets of the
    same leading shape. Equals edgetrain.training.losses.lm_loss: fp32 softmax, mean over valid tokens.
    `chunk` tokens x `vocab_chunk` vocabulary entries is the largest temporary. `soft_cap`: the logits are
    cap * tanh(z / cap) (Gemma's final soft-cap); each entry's row then weighs by the cap's slope 1 - tanh^2.
    Returns (loss as a 0-dim tensor, fp32 -- fp64 for fp64 inputs --, dL/dhidden shaped and typed
    like hidden).
    """
    if chunk < 1 or vocab_chunk < 1:
        raise ValueError(f"loss chunk sizes must be positive, got chunk={chunk}, vocab_chunk={vocab_chunk}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} do not match hidden {tuple(hidden.shape)}")
    dtype, work = hidden.dtype, compute_dtype(hidden.dtype)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    valid = flat_targets != IGNORE_INDEX
    num_valid = valid.sum()
    # 1/N as a tensor: no host sync, and 0 valid tokens give nan as F.cross_entropy does.
    inverse_count = num_valid.to(work).reciprocal()
    vocab_size, weight_rows, gather_rows = _row_readers(lm_weight, dtype)
    loss_sum = torch.zeros((), dtype=torch.float64, device=hidden.device)
    grad_hidden = torch.empty_like(flat_hidden)
    for start in range(0, flat_hidden.shape[0], chunk):
        stop = min(start + chunk, flat_hidden.shape[0])
        hidden_chunk = flat_hidden[start:stop]
        normed = rms_norm_forward(hidden_chunk, norm_weight, eps)
        chunk_valid = valid[start:stop]
        safe_targets = flat_targets[start:stop].masked_fill(~chunk_valid, 0).unsqueeze(1)
        rows = stop - start
        running_max = torch.full((rows, 1), float("-inf"), dtype=work, device=hidden.device)
        target_logits = torch.zeros((rows, 1), dtype=work, device=hidden.device)
        # Over the non-target entries v, rescaled whenever the running max grows:
        # sum exp(l_v - max)  and  sum exp(l_v - max) W_v.
        other_exp_sum = torch.zeros_like(running_max)
        other_weighted_rows = torch.zeros(rows, hidden.shape[-1], dtype=work, device=hidden.device)
        for vocab_start in range(0, vocab_size, vocab_chunk):
            weight_block = weight_rows(vocab_start, min(vocab_start + vocab_chunk, vocab_size))
            logits = matmul(normed, weight_block.t())
            if logits.dtype != work:  # lm_loss upcasts the model's logits the same way
                logits = logits.to(work)
            slopes = None
            if soft_cap is not None:  # as the model's head: tanh(z / cap) * cap
                logits = torch.tanh(logits.div_(soft_cap))
                slopes = 1 - logits * logits
                logits.mul_(soft_cap)
            in_tile = (safe_targets >= vocab_start) & (safe_targets < vocab_start + logits.shape[1])
            tile_targets = (safe_targets - vocab_start).clamp_(0, logits.shape[1] - 1)
            target_logits = torch.where(in_tile, logits.gather(1, tile_targets), target_logits)
            new_max = torch.maximum(running_max, logits.amax(1, keepdim=True))
            rescale = (running_max - new_max).exp_()  # 0 on the first tile (exp(-inf))
            other_exp_sum.mul_(rescale)
            other_weighted_rows.mul_(rescale)
            exps = logits.sub_(new_max).exp_()  # in place: still the one [rows, vocab_chunk] buffer
            # The target's own term is left out here and added exactly at the end, so that
            # dL/dn = ((sum_{v != t} p_v W_v) - (1 - p_t) W_t) / N has no cancellation when p_t ~ 1.
            exps.scatter_(1, tile_targets, torch.where(in_tile, 0, exps.gather(1, tile_targets)))
            other_exp_sum.add_(exps.sum(1, keepdim=True))
            weighted = exps if slopes is None else exps.mul_(slopes)
            other_weighted_rows.addmm_(weighted, weight_block if weight_block.dtype == work else weight_block.to(work))
            del logits, exps, weighted, slopes
            running_max = new_max
        exp_sum = other_exp_sum + (target_logits - running_max).exp()
        # -log p_t = log(1 + sum_{v != t} exp(l_v - l_t)): log1p keeps a nearly certain target's small
        # loss exact; far below the max (gap >= 30, loss >= 30) the plain form is exact enough and
        # cannot overflow.
        gap = running_max - target_logits
        token_loss = torch.where(gap < 30, torch.log1p(other_exp_sum * gap.clamp(max=30).exp()), gap + exp_sum.log())
        loss_sum += torch.where(chunk_valid.unsqueeze(1), token_loss, 0).sum(dtype=torch.float64)
        # dL/dnormed = (softmax W - W[target]) / N on valid rows, 0 on ignored ones.
        row_weight = chunk_valid.to(work).mul_(inverse_count).unsqueeze(1)
        target_rows = gather_rows(safe_targets.squeeze(1)).to(work)
        if soft_cap is not None:  # the target's own slope
            target_rows.mul_(1 - (target_logits / soft_cap) ** 2)
        grad_normed = other_weighted_rows.sub_(target_rows.mul_(other_exp_sum))
        grad_normed = grad_normed.mul_(row_weight / exp_sum).to(dtype)
        del other_weighted_rows, target_rows, normed
        grad_hidden[start:stop] = rms_norm_backward(hidden_chunk, norm_weight, eps, grad_normed)
    loss = (loss_sum / num_valid).to(work)
    return loss, grad_hidden.view(hidden.shape)


def _row_readers(lm_weight: torch.Tensor | Any, dtype: torch.dtype
                 ) -> tuple[int, Callable[[int, int], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
    """(vocabulary size, rows [start, stop), rows at indices) of a dense weight or a quantised head."""
    if isinstance(lm_weight, torch.Tensor):
        return lm_weight.shape[0], lambda start, stop: lm_weight[start:stop], lambda rows: lm_weight[rows]
    # The tile lives in a scratch buffer the next tile overwrites: it is used only within its iteration.
    return (lm_weight.out_features, lambda start, stop: lm_weight.dequantize_rows(start, stop, dtype, scratch=True),
            lambda rows: lm_weight.dequantize_gathered(rows, dtype))
