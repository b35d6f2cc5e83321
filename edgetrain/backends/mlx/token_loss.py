"""Per-token held-out loss of an MLX decoder without its whole logits: the blocks run on a few rows at a
time (rows_per_pass), the head on EVAL_TOKEN_CHUNK predicted positions at a time (the torch side:
edgetrain.models.token_loss)."""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from edgetrain.models.token_loss import EVAL_TOKEN_CHUNK, rows_per_pass
from edgetrain.training.losses import IGNORE_INDEX


def token_losses(model: "object", inputs: mx.array, targets: mx.array, token_chunk: int | None = None) -> np.ndarray:
    """The next-token cross-entropy of every position with a target, float64 (fp32 log-softmax, as lm_loss),
    in row order."""
    step = rows_per_pass(inputs.shape[1])
    parts = [_rows_token_losses(model, inputs[start:start + step], targets[start:start + step], token_chunk)
             for start in range(0, inputs.shape[0], step)]
    return np.concatenate(parts) if parts else np.zeros(0)


def _rows_token_losses(model: "object", inputs: mx.array, targets: mx.array, token_chunk: int | None) -> np.ndarray:
    chunk = token_chunk or EVAL_TOKEN_CHUNK
    h = model.embed(inputs)
    for block, rope in zip(model.blocks, model.block_ropes(inputs.shape[1], h.dtype)):
        h = block(h, rope)
    predicted = np.flatnonzero(np.array(targets).reshape(-1) != IGNORE_INDEX)
    hidden = h.reshape(-1, h.shape[-1])[mx.array(predicted)]
    wanted = targets.reshape(-1)[mx.array(predicted)]
    mx.eval(hidden)
    losses = []
    for start in range(0, predicted.size, chunk):
        logits = model.logits(hidden[start:start + chunk]).astype(mx.float32)
        chunk_targets = wanted[start:start + chunk]
        chunk_losses = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, chunk_targets[:, None], axis=-1)[:, 0]
        losses.append(np.array(chunk_losses, dtype=np.float64))
    return np.concatenate(losses) if losses else np.zeros(0)
