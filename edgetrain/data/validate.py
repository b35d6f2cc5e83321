"""Refuse malformed batches before they reach a model: a clear error naming the batch, never a NaN loss
or an index error deep inside an embedding."""
from __future__ import annotations

import math
from typing import Any

import torch

from edgetrain.data.batch import Batch
from edgetrain.registry import EdgetrainError
from edgetrain.training.losses import IGNORE_INDEX


class BadBatchError(EdgetrainError, ValueError):
    """A batch with the wrong dtype, out-of-range ids, NaN/inf values, mismatched sizes or no data."""


# Token ids and labels are int64 (torch.long), nothing narrower, and they are not converted here. The
# losses take only int64 targets (cross-entropy refuses int16/int32) and MeSP only int64 ids; and a
# conversion here could not undo what a narrower type has already done where the ids were made: an id
# above 32767 stored as int16 has wrapped to another (often valid) id or a negative one, and uint8
# cannot hold the ignore index -100. So the message sends the producer to build them as int64.
ID_DTYPE = torch.int64


def _is_integer(tensor: torch.Tensor) -> bool:
    return not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool)


def _shape_text(shape: tuple[int | None, ...]) -> str:
    return "[B, " + ", ".join("*" if d is None else str(d) for d in shape) + "]"


def batch_expectations(model: Any) -> dict[str, Any]:
    """What `validate_batch` should require of a batch for `model`, read off what the model says about
    itself: its task, and from `model.config` the vocabulary (token models: [B, T] ids), the number of
    classes, and the per-sample input shape -- `input_shape` (MLPs and ConvNets, which flatten or
    reshape their input, so only the number of values per sample counts), `image_size` and
    `in_channels` (ViT: [B, C, S, S]), or `in_channels` alone (ResNets, MobileNets: [B, C, H, W]).
    A model that says nothing gets only the checks that need no model."""
    config = getattr(model, "config", None)
    vocab_size = getattr(config, "vocab_size", None)
    expectations: dict[str, Any] = {"task": getattr(model, "task", "classify"), "vocab_size": vocab_size,
                                    "num_classes": getattr(config, "num_classes", None)}
    if vocab_size is not None:
        return expectations
    input_shape = getattr(config, "input_shape", None)
    channels, image_size = getattr(config, "in_channels", None), getattr(config, "image_size", None)
    if input_shape is not None:
        expectations.update(expect_float=True, input_size=math.prod(input_shape), input_shape=tuple(input_shape))
    elif isinstance(channels, int) and isinstance(image_size, int):
        expectations.update(expect_float=True, input_shape=(channels, image_size, image_size))
    elif isinstance(channels, int):
        expectations.update(expect_float=True, input_shape=(channels, None, None))
    return expectations


def validate_batch(batch: Batch, *, vocab_size: int | None = None, expect_float: bool | None = None,
                   task: str | None = None, num_classes: int | None = None,
                   input_shape: tuple[int | None, ...] | None = None, input_size: int | None = None) -> None:
    """Raise BadBatchError, whose message starts with "batch <index>:", unless the batch is well formed.

    The index must be a non-negative int (not a bool): it is the batch's position in its stream, which
    a checkpoint stores to resume from. Targets must be int64 (ID_DTYPE; see there why nothing narrower).
    expect_float: True for feature inputs (must be floating point), False for token ids (must be
    int64, shaped [B, T]); None takes token ids when `vocab_size` is given or the task is "lm", and
    otherwise accepts either. vocab_size: token ids (and LM targets) must lie in [0, vocab_size).
    task: "lm" (inputs [B, T] token ids, targets [B, T] like the inputs, -100 = no target) or
    "classify" (targets [B] class ids); None infers it from the targets' rank.
    num_classes: labels must lie in [0, num_classes).
    input_shape: the per-sample shape of feature inputs, None for a free extent; input_size: the number
    of values per sample. With input_size, any [B, ...] holding that many values per sample passes
    (the model flattens it); without, inputs must be [B, *input_shape] exactly.
    Float inputs must be finite; inputs and targets must be non-empty with the same batch size.
    """
    index = getattr(batch, "index", "?")
    where = f"batch {index}"
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise BadBatchError(f"{where}: index must be a non-negative int (the batch's position in its stream), "
                            f"got {index!r} ({type(index).__name__})")
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
    if targets.dtype != ID_DTYPE:
        raise BadBatchError(f"{where}: targets must be int64 (torch.long), got {targets.dtype}; make them int64 "
                            "where they are created (a narrower type may already have wrapped large ids)")

    task = task or ("lm" if targets.dim() >= 2 else "classify")
    if expect_float is None and (vocab_size is not None or task == "lm"):
        expect_float = False
    if expect_float is True and not inputs.is_floating_point():
        raise BadBatchError(f"{where}: features must be floating point, got {inputs.dtype}")
    if expect_float is False:
        if not _is_integer(inputs):
            raise BadBatchError(f"{where}: token ids must be integers, got {inputs.dtype}")
        if inputs.dtype != ID_DTYPE:
            raise BadBatchError(f"{where}: token ids must be int64 (torch.long), got {inputs.dtype}; make them "
                                "int64 where they are created (a narrower type may already have wrapped large ids)")
        if inputs.dim() != 2:
            raise BadBatchError(f"{where}: token ids must be 2-D [B, T] (batch, sequence), got shape "
                                f"{tuple(inputs.shape)}")
    if input_shape is not None or input_size is not None:
        _check_feature_shape(where, inputs, input_shape, input_size)
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
        if targets.dim() != 1:
            raise BadBatchError(f"{where}: class labels must be 1-D [B], got shape {tuple(targets.shape)}")
        low, high = int(targets.min()), int(targets.max())
        if low < 0 or (num_classes is not None and high >= num_classes):
            bound = f"[0, {num_classes})" if num_classes is not None else "[0, num_classes)"
            raise BadBatchError(f"{where}: label outside {bound} (got {low if low < 0 else high})")


def _check_feature_shape(where: str, inputs: torch.Tensor, input_shape: tuple[int | None, ...] | None,
                         input_size: int | None) -> None:
    sample = tuple(inputs.shape[1:])
    if input_size is not None:
        if inputs.dim() >= 2 and math.prod(sample) == input_size:
            return
        expected = _shape_text(input_shape) + " or " if input_shape is not None and len(input_shape) > 1 else ""
        raise BadBatchError(f"{where}: inputs of shape {tuple(inputs.shape)} do not fit the model: expected "
                            f"{expected}[B, {input_size}] ({input_size} values per sample)")
    assert input_shape is not None
    fits = len(sample) == len(input_shape) and all(e is None or e == d for e, d in zip(input_shape, sample))
    if not fits:
        raise BadBatchError(f"{where}: inputs of shape {tuple(inputs.shape)} do not fit the model: expected "
                            f"{_shape_text(input_shape)}")
