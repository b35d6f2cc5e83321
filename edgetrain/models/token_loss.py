"""Held-out loss of a decoder without its whole logits: the blocks run on the whole batch, the head on a
chunk of predicted positions at a time, as training's chunked loss does. A batch of 16 x 64 positions of
SmolLM2 would otherwise hold 192 MiB of fp32 logits and their log-softmax as much again."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgetrain.training.losses import IGNORE_INDEX

# Positions whose logits exist at once when a held-out loss is computed: 64 x 49,152 (SmolLM2) in fp32 is
# 12 MiB, where a whole batch of 4 x 128 positions took 192 MiB in fp64 (and its log-softmax as much again).
# Fewer would cost time with a packed head, which dequantises its whole table once per call.
EVAL_TOKEN_CHUNK = 64


def summed_token_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                      token_chunk: int = EVAL_TOKEN_CHUNK) -> tuple[float, int]:
    """(summed next-token cross-entropy in fp64, predicted tokens) of one batch: the blocks run on the whole
    batch, the head on `token_chunk` predicted positions at a time (ignored ones, -100, are skipped), so
    the logits never exist for the whole batch, as in training's chunked loss."""
    h = model.embed(inputs)
    for block in model.blocks:
        h = block(h)
    targets = targets.flatten()
    predicted = targets != IGNORE_INDEX
    hidden = h.flatten(0, 1)[predicted]
    targets = targets[predicted]
    total = 0.0
    for start in range(0, targets.shape[0], token_chunk):
        logits = model.head(hidden[start:start + token_chunk])
        # fp32 log-softmax at least (lm_loss's precision), each token's loss summed in fp64
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        losses = F.cross_entropy(logits, targets[start:start + token_chunk], reduction="none")
        total += float(losses.sum(dtype=torch.float64))
    return total, int(targets.shape[0])


def is_block_decoder(model: nn.Module) -> bool:
    """Whether summed_token_loss runs `model`: a language model of embed, blocks called on h alone, head."""
    from edgetrain.models.llama import DecoderBlock

    blocks = getattr(model, "blocks", None)
    return (getattr(model, "task", None) == "lm" and blocks is not None and hasattr(model, "embed")
            and hasattr(model, "head") and all(isinstance(block, DecoderBlock) for block in blocks))
