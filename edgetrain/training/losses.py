"""Task losses, keyed by the model's `task` attribute."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from edgetrain.registry import Registry
from edgetrain.training.precision import compute_dtype

IGNORE_INDEX = -100

TASK_LOSSES: Registry[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = Registry("task")


@TASK_LOSSES.register("lm")
def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over positions with a target, computed in fp32 (in fp64 for an
    fp64 model: edgetrain.training.precision).

    `targets` is already aligned with `logits` (targets[:, t] is the token after input t)."""
    flat = logits.flatten(0, -2)
    return F.cross_entropy(flat.to(compute_dtype(flat.dtype)), targets.flatten(), ignore_index=IGNORE_INDEX)


@TASK_LOSSES.register("classify")
def classify_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.to(compute_dtype(logits.dtype)), targets)


def task_loss(model: torch.nn.Module, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return TASK_LOSSES.get(getattr(model, "task", "classify"))(outputs, targets)
