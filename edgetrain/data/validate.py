"""Refuse malformed batches before they reach a model: a clear error naming the batch, never a NaN loss."""
from __future__ import annotations

import torch

from edgetrain.data.batch import Batch
from edgetrain.losses import IGNORE_INDEX
from edgetrain.registry import EdgetrainError


class BadBatchError(EdgetrainError, ValueError):
    """A batch with the wrong dtype, out-of-range ids, NaN/inf values or mismatched sizes."""


def validate_batch(batch: Batch, *, task: str, vocab_size: int | None = None,
                   num_classes: int | None = None) -> None:
    where = f"batch {batch.index}"
    inputs, targets = batch.inputs, batch.targets
    if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise BadBatchError(f"{where}: inputs and targets must be tensors")
    if inputs.numel() == 0 or inputs.dim() == 0:
        raise BadBatchError(f"{where}: empty inputs")
    if inputs.shape[0] != targets.shape[0]:
        raise BadBatchError(f"{where}: {inputs.shape[0]} inputs but {targets.shape[0]} targets")
    if targets.is_floating_point() or targets.dtype == torch.bool:
        raise BadBatchError(f"{where}: targets must be integer ids, got {targets.dtype}")
    if vocab_size is not None:  # token inputs
        if inputs.is_floating_point() or inputs.dtype == torch.bool:
            raise BadBatchError(f"{where}: token ids must be integers, got {inputs.dtype}")
        low, high = int(inputs.min()), int(inputs.max())
        if low < 0 or high >= vocab_size:
            raise BadBatchError(f"{where}: token id {low if low < 0 else high} outside the vocabulary [0, {vocab_size})")
    elif inputs.is_floating_point():
        if not bool(torch.isfinite(inputs).all()):
            raise BadBatchError(f"{where}: inputs contain NaN or inf")
    if task == "lm":
        if targets.shape != inputs.shape:
            raise BadBatchError(f"{where}: LM targets {tuple(targets.shape)} must match inputs {tuple(inputs.shape)}")
        valid = targets[targets != IGNORE_INDEX]
        if valid.numel() == 0:
            raise BadBatchError(f"{where}: every target is ignored ({IGNORE_INDEX})")
        if vocab_size is not None and (int(valid.min()) < 0 or int(valid.max()) >= vocab_size):
            raise BadBatchError(f"{where}: target id outside the vocabulary [0, {vocab_size})")
    elif num_classes is not None and (int(targets.min()) < 0 or int(targets.max()) >= num_classes):
        raise BadBatchError(f"{where}: label outside [0, {num_classes})")
