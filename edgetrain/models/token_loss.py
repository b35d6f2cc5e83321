"""Held-out loss of a decoder without its whole logits or its whole batch's activations: the blocks run on
a few rows (sequences) at a time, the head on a chunk of predicted positions at a time, as training's
chunked loss does. A batch of 16 x 64 positions of SmolLM2 would otherwise hold 192 MiB of fp32 logits and
their log-softmax as much again; the personaliser's gate batch of 16 x 256 positions held 70 MiB of one
block's attention scores and MLP activations."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgetrain.training.losses import IGNORE_INDEX

# Positions whose logits exist at once when a held-out loss is computed: 64 x 49,152 (SmolLM2) in fp32 is
# 12 MiB, where a whole batch of 4 x 128 positions took 192 MiB in fp64 (and its log-softmax as much again).
# Fewer would cost time with a packed head, which dequantises its whole table once per call.
EVAL_TOKEN_CHUNK = 64


# Positions the blocks run on at once: whole rows (a sequence attends only to itself), as many as fit. For
# SmolLM2 512 positions are 3 MiB of one MLP activation; 16 rows of 256 held 70 MiB of one block's temporaries.
EVAL_BLOCK_POSITIONS = 512


def rows_per_pass(seq_len: int, positions: int | None = None) -> int:
    """Rows of `seq_len` positions the blocks run on together: at least one, at most `positions`
    (EVAL_BLOCK_POSITIONS) positions."""
    return max(1, (positions or EVAL_BLOCK_POSITIONS) // max(1, seq_len))


def summed_token_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                      token_chunk: int = EVAL_TOKEN_CHUNK) -> tuple[float, int]:
    """(summed next-token cross-entropy in fp64, predicted tokens) of one batch: the blocks run on
    rows_per_pass rows at a time; the head reads its LM weight a tile of vocabulary rows at a time with a
    running log-sum-exp, as training's chunked loss does (edgetrain.methods.mesp.loss), so neither the
    logits nor a packed head's dense table ever exist whole. A head it cannot tile (a bias, an adapter on
    the LM head) runs on `token_chunk` predicted positions at a time. Ignored positions (-100) are skipped."""
    step = rows_per_pass(inputs.shape[1])
    total, count = 0.0, 0
    for start in range(0, inputs.shape[0], step):
        rows_total, rows_count = _rows_token_loss(model, inputs[start:start + step], targets[start:start + step],
                                                  token_chunk)
        total, count = total + rows_total, count + rows_count
    return total, count


def _rows_token_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                     token_chunk: int) -> tuple[float, int]:
    h = model.embed(inputs)
    for block in model.blocks:
        h = block(h)
    targets = targets.flatten()
    predicted = targets != IGNORE_INDEX
    hidden = h.flatten(0, 1)[predicted]
    targets = targets[predicted]
    rows = _vocabulary_rows(model.head, hidden)
    total = 0.0
    for start in range(0, targets.shape[0], token_chunk if rows is None else TILED_TOKEN_ROWS):
        stop = start + (token_chunk if rows is None else TILED_TOKEN_ROWS)
        if rows is None:
            logits = model.head(hidden[start:stop])
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # lm_loss's precision
            losses = F.cross_entropy(logits, targets[start:stop], reduction="none")
        else:
            losses = _tiled_losses(model.head.norm(hidden[start:stop]), targets[start:stop], *rows)
        total += float(losses.sum(dtype=torch.float64))
    return total, int(targets.shape[0])


# Positions per pass of the vocabulary tiles: [1024, 4096] fp32 logits are 16 MiB (a packed head on a CPU
# reads 512 rows a tile: 2 MiB).
TILED_TOKEN_ROWS = 1024


def _vocabulary_rows(head: nn.Module, hidden: torch.Tensor):
    """(vocabulary size, rows(start, stop) of the LM weight, tile rows) of a final-norm + LM-head module
    whose weight can be read in tiles of rows (a plain Linear, a packed one, a packed tied head); else None."""
    from edgetrain.methods.mesp.loss import default_vocab_chunk
    from edgetrain.models.quantized import QuantizedLinear, TiedQuantizedHead

    lm_head, norm = getattr(head, "lm_head", None), getattr(head, "norm", None)
    if norm is None or getattr(lm_head, "bias", None) is not None:
        return None
    if type(lm_head) is nn.Linear:
        weight = lm_head.weight
        return weight.shape[0], (lambda start, stop: weight[start:stop]), default_vocab_chunk(False, hidden.device)
    if isinstance(lm_head, (QuantizedLinear, TiedQuantizedHead)):
        return (lm_head.out_features,
                lambda start, stop: lm_head.dequantize_rows(start, stop, hidden.dtype, scratch=True),
                default_vocab_chunk(True, hidden.device))
    return None


def _tiled_losses(normed: torch.Tensor, targets: torch.Tensor, vocab_size: int, rows, tile: int) -> torch.Tensor:
    """Each position's -log softmax(normed W^T)[target], one [positions, tile] block of logits at a time."""
    work = torch.promote_types(normed.dtype, torch.float32)
    normed = normed.to(work)
    running_max = torch.full((normed.shape[0], 1), float("-inf"), dtype=work, device=normed.device)
    exp_sum = torch.zeros_like(running_max)
    target_logits = torch.zeros_like(running_max)
    wanted = targets.unsqueeze(1)
    for start in range(0, vocab_size, tile):
        logits = normed @ rows(start, min(start + tile, vocab_size)).to(work).t()
        in_tile = (wanted >= start) & (wanted < start + logits.shape[1])
        target_logits = torch.where(in_tile, logits.gather(1, (wanted - start).clamp(0, logits.shape[1] - 1)),
                                    target_logits)
        new_max = torch.maximum(running_max, logits.amax(1, keepdim=True))
        exp_sum = exp_sum * (running_max - new_max).exp() + (logits - new_max).exp().sum(1, keepdim=True)
        running_max = new_max
    return (running_max + exp_sum.log() - target_logits).squeeze(1)


def is_block_decoder(model: nn.Module) -> bool:
    """Whether summed_token_loss runs `model`: a language model of embed, blocks called on h alone, head."""
    from edgetrain.models.llama import DecoderBlock

    blocks = getattr(model, "blocks", None)
    return (getattr(model, "task", None) == "lm" and blocks is not None and hasattr(model, "embed")
            and hasattr(model, "head") and all(isinstance(block, DecoderBlock) for block in blocks))
