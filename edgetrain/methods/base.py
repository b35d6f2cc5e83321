"""The contract every training method meets, and the registry that finds methods by name.

A method owns how a step's gradient (or estimate) is produced and applied; the learner owns the
loop, the clock, the probe and the checkpoints. Methods see the model only through its block view.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Protocol

import torch
from torch import nn

from edgetrain.data.batch import Batch
from edgetrain.registry import EdgetrainError, Registry


class TrainingMethod(Protocol):
    name: str

    def gradients(self, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss (a detached scalar) and the gradient, or the method's estimate of it, for every
        trainable parameter by name -- without changing the weights."""

    def step(self, batch: Batch, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """One training step on `batch`; returns the detached loss (of the weights before the update)."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state needed to resume exactly (seeds, counters)."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# A method that applies updates in stages within one step (MeSP's per-block fused update) sets
# `partial_updates = True`; the learner then snapshots the trainable weights and optimizer state before
# each step so that a non-finite gradient found half-way leaves the last good weights in place.


class TrainingError(EdgetrainError, RuntimeError):
    """A step that could not be taken (non-finite loss or gradient, memory budget exceeded, ...)."""


class NonFiniteError(TrainingError):
    """A loss, gradient or update that is NaN or infinite; raised before any weight changes."""


def require_finite(value: float, what: str) -> None:
    if not math.isfinite(value):
        raise NonFiniteError(f"non-finite {what} ({value})")


# name -> constructor(model, **options)
METHODS: Registry[Callable[..., TrainingMethod]] = Registry("method")


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise EdgetrainError(f"{type(model).__name__} has no trainable parameters "
                             "(every weight is frozen; add LoRA adapters or unfreeze some)")
    return params


def take_gradients(params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    """Move .grad out of the parameters into a dict (zeros for parameters autograd did not reach)."""
    grads = {}
    for name, param in params.items():
        grads[name] = param.grad if param.grad is not None else torch.zeros_like(param)
        param.grad = None
    return grads


def apply_gradients(params: dict[str, nn.Parameter], grads: dict[str, torch.Tensor],
                    optimizer: torch.optim.Optimizer) -> None:
    for name, param in params.items():
        param.grad = grads[name]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def no_options(name: str, options: dict[str, Any]) -> None:
    if options:
        raise EdgetrainError(f"method {name!r} takes no options; got {', '.join(sorted(options))}")
