"""Refuse malformed batches before they reach a model: a clear error naming the batch, never a NaN loss
or an index error deep inside an embedding."""
from __future__ import annotations

import torch

from edgetrain.data.batch import Batch
from edgetrain.losses import IGNORE_INDEX
from edgetrain.registry import EdgetrainError


class BadBatchError(EdgetrainError, ValueError):
    """A batch with the wrong dtype, out-of-range ids, NaN/inf values, mismatched sizes or no data."""


def _is_integer(tensor: torch.Tensor) -> bool:
    return not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool)


def validate_batch(batch: Batch, *, vocab_size: int | None = None, expect_float: bool | None = None,
                   task: str | None = None, num_classes: int | None = None) -> None:
    """Raise BadBatchError, whose message starts with "batch <index>:", unless the batch is well formed.

    expect_float: True for feature inputs (must be floating point), False for token ids (must be
    integers); None takes token ids when `vocab_size` is given and otherwise accepts either.
    vocab_size: token ids (and LM targets) must lie in [0, vocab_size).
    task: "lm" (targets [B, T] like the inputs, -100 = no target) or "classify" (class ids);
    None infers it from the targets' rank. num_classes: labels must lie in [0, num_classes).
    Float inputs must be finite; inputs and targets must be non-empty with the same batch size.
    """
    where = f"batch {getattr(batch, 'index', '?')}"
    inputs, targets = getattr(batch, "inputs", None), getattr(batch, "targets", None)
    if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise BadBatchError(f"{where}: inputs and targets must be tensors, got {type(inputs).__name__} "
                            f"and {type(targets).__name__}")
    if inputs.dim() == 0 or inputs.numel() == 0:
        raise BadBatchError(f"{where}: empty inputs (shape {tuple(inputs.shape)})")
    if targets.dim() == 0 or targets.numel() == 0:
        raise BadBatchError(f"{where}: empty targets (shape {tuple(targets.shape)})")
    if inputs.shape[0] != targets.shape[0]:
        raise BadBatchError(f"{where}: {inputs.shape[0]} inputs but {targets.shape[0]} targets")
    if not _is_integer(targets):
        raise BadBatchError(f"{where}: targets must be integer ids, got {targets.dtype}")

    if expect_float is None and vocab_size is not None:
        expect_float = False
    if expect_float is True and not inputs.is_floating_point():
        raise BadBatchError(f"{where}: features must be floating point, got {inputs.dtype}")
    if expect_float is False and not _is_integer(inputs):
        raise BadBatchError(f"{where}: token ids must be integers, got {inputs.dtype}")
    if inputs.is_floating_point():
        if not bool(torch.isfinite(inputs).all()):
            bad = "NaN" if bool(torch.isnan(inputs).any()) else "inf"
            raise BadBatchError(f"{where}: inputs contain {bad} (NaN or inf values are refused)")
    elif not _is_integer(inputs):
        raise BadBatchError(f"{where}: inputs must be integer token ids or float features, got {inputs.dtype}")
    elif vocab_size is not None:
        low, high = int(inputs.min()), int(inputs.max())
        if low < 0 or high >= vocab_size:
            raise BadBatchError(f"{where}: token id {low if low < 0 else high} outside the vocabulary "
                                f"[0, {vocab_size})")

    task = task or ("lm" if targets.dim() >= 2 else "classify")
    if task == "lm":
        if targets.shape != inputs.shape:
            raise BadBatchError(f"{where}: LM targets {tuple(targets.shape)} must match inputs {tuple(inputs.shape)}")
        valid = targets[targets != IGNORE_INDEX]
        if valid.numel() == 0:
            raise BadBatchError(f"{where}: every target is ignored ({IGNORE_INDEX})")
        low, high = int(valid.min()), int(valid.max())
        if low < 0 or (vocab_size is not None and high >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else "(negative and not the ignore index)"
            raise BadBatchError(f"{where}: target id {low if low < 0 else high} outside the vocabulary {bound}")
    else:
        low, high = int(targets.min()), int(targets.max())
        if low < 0 or (num_classes is not None and high >= num_classes):
            bound = f"[0, {num_classes})" if num_classes is not None else "[0, num_classes)"
            raise BadBatchError(f"{where}: label outside {bound} (got {low if low < 0 else high})")
