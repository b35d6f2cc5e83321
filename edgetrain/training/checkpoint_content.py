"""What a learner checkpoint holds, checked against the learner before anything is restored.

A checksum proves that a file is what its writer wrote, not that the writer was right, nor that the file is
from this model: a re-checksummed file can hold a parameter stored as int32, NaN weights, an optimizer
moment of another shape or a learning rate of 1e30. Each such content is a CorruptCheckpointError naming the
file, the tensor or setting, and why, so that resume skips the file and falls back to the previous good
checkpoint, exactly as for a file that fails its checksum. Framework-free where it can be: the tensors of a
checkpoint are torch tensors on every backend (the file is read with safetensors' torch framework).
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import torch

from edgetrain.training.checkpoint import CorruptCheckpointError
from edgetrain.training.schedules import ScheduleError, check_learning_rate

__all__ = ["check_saved_tensor", "check_optimizer_state", "check_hyper_parameters"]

# Torch optimizer settings a checkpoint may hold, with the range their constructors accept (the learning rate:
# edgetrain's own range, check_learning_rate's).
_NON_NEGATIVE = ("eps", "weight_decay", "momentum", "dampening", "lr_decay", "initial_accumulator_value")
_SQUARES = ("exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum")
_FLAGS = ("amsgrad", "nesterov", "maximize", "foreach", "capturable", "differentiable", "fused",
          "decoupled_weight_decay")


def _refuse(source: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{source}: {what}; the checkpoint cannot be from this learner's run")


def check_saved_tensor(saved: Any, name: str, shape: tuple[int, ...], source: str,
                       dtype: torch.dtype | None = None, floating: bool = True) -> torch.Tensor:
    """`saved`, the checkpoint's tensor `name`, after checking that it is there, has `shape`, `dtype` (when
    given; else a floating-point dtype if `floating`) and holds only finite values."""
    if not isinstance(saved, torch.Tensor):
        raise _refuse(source, f"{name} is missing")
    if tuple(saved.shape) != tuple(shape):
        raise _refuse(source, f"{name} has shape {tuple(saved.shape)}, the learner's is {tuple(shape)}")
    if dtype is not None and saved.dtype != dtype:
        raise _refuse(source, f"{name} is stored as {saved.dtype}, the learner's is {dtype}")
    if dtype is None and floating and not saved.is_floating_point():
        raise _refuse(source, f"{name} is stored as {saved.dtype}, not a floating-point type")
    if saved.is_floating_point() and saved.numel() and not bool(torch.isfinite(saved).all()):
        bad = int((~torch.isfinite(saved)).sum())
        raise _refuse(source, f"{name} holds {bad} non-finite value(s) (NaN or inf)")
    return saved


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_hyper_parameters(group: Mapping[str, Any], index: int, source: str) -> None:
    """A saved optimizer group's settings within what its constructor accepts: a learning rate in
    [0, 1e6], betas in [0, 1), non-negative finite eps, weight decay and momentum, flags true or false."""
    where = f"optimizer group {index}"
    try:
        check_learning_rate(group.get("lr"), f"{where}'s learning rate")
    except ScheduleError as exc:
        raise _refuse(source, str(exc)) from None
    betas = group.get("betas")
    if betas is not None and not (isinstance(betas, (list, tuple)) and len(betas) == 2
                                  and all(_number(b) and 0 <= b < 1 for b in betas)):
        raise _refuse(source, f"{where} has betas {betas!r}; each must be in [0, 1)")
    for key in _NON_NEGATIVE:
        value = group.get(key)
        if value is not None and not (_number(value) and value >= 0):
            raise _refuse(source, f"{where} has {key} {value!r}; it must be a finite number >= 0")
    for key in _FLAGS:
        value = group.get(key)
        if value is not None and not isinstance(value, bool):
            raise _refuse(source, f"{where} has {key} {value!r}; it must be true or false")


def check_optimizer_state(saved: Any, current: Mapping[str, Any], shapes: Iterable[tuple[int, ...]],
                          source: str) -> None:
    """A torch optimizer state_dict from a checkpoint (`saved`) that this learner's optimizer (`current`,
    its state_dict now) can load and step from: the same groups over the same parameters, settings in range
    (a setting the saved group lacks is torch's to default: files of an older torch keep loading), and per parameter only tensors of that parameter's shape (or a scalar step
    count), finite, floating point, with a step count >= 0."""
    shapes = list(shapes)
    if not isinstance(saved, Mapping) or not isinstance(saved.get("param_groups"), list) \
            or not isinstance(saved.get("state"), Mapping):
        raise _refuse(source, "the optimizer state is not a torch optimizer state")
    groups, expected = saved["param_groups"], current["param_groups"]
    if len(groups) != len(expected):
        raise _refuse(source, f"the optimizer state has {len(groups)} parameter group(s), the learner's optimizer "
                              f"{len(expected)}")
    for index, (group, mine) in enumerate(zip(groups, expected)):
        if not isinstance(group, Mapping):
            raise _refuse(source, f"optimizer group {index} is not an object")
        if group.get("params") != mine["params"]:
            raise _refuse(source, f"optimizer group {index} holds parameters {group.get('params')!r}, the learner's "
                                  f"{mine['params']!r}")
        check_hyper_parameters(group, index, source)
    for index, per_param in saved["state"].items():
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(shapes) \
                or not isinstance(per_param, Mapping):
            raise _refuse(source, f"the optimizer state names parameter {index!r}, which the learner does not have")
        for key, value in per_param.items():
            name = f"optimizer state {key!r} of parameter {index}"
            if key == "step":
                step = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
                if not (_number(step) and step >= 0):
                    raise _refuse(source, f"{name} is {value!r}; a step count is a finite number >= 0")
            elif isinstance(value, torch.Tensor):
                check_saved_tensor(value, name, shapes[index], source)
                # Adam's second moments are averages of squares: a negative one has no square root, and the
                # next step would be NaN.
                if key in _SQUARES and bool((value < 0).any()):
                    raise _refuse(source, f"{name} holds negative values; it is an average of squares")
            elif value is not None and not _number(value):
                raise _refuse(source, f"{name} is {value!r}, not a finite number")
