"""The contract every training method meets, and the registry that finds methods by name.

A method owns how a step's gradient (or estimate) is produced and applied; the learner owns the
loop, the clock, the probe and the checkpoints. Methods see the model only through its block view.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Protocol

import torch
from torch import nn

from edgetrain.backends.torch import eager_optimizers
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


def require_step_fits(step: float, param: torch.Tensor, name: str, method: str) -> None:
    """torch converts the scale of `param.add_(direction, alpha=step)` to the parameter's dtype and raises
    a bare RuntimeError when it does not fit (|step| > 65504 for float16): refuse it by name instead.
    Such a step times a direction of unit scale overflows the parameter anyway."""
    require_finite(step, f"update step of {name}")
    if param.is_floating_point() and abs(step) > torch.finfo(param.dtype).max:
        raise NonFiniteError(f"{method}: the update step {step:.3g} of {name} overflows {param.dtype}; "
                             "no weight was changed")


def require_finite_update(updated: torch.Tensor, name: str, method: str) -> None:
    """Refuse an update whose result (computed into a temporary, before any weight is written) is not
    finite: a finite step size times a finite direction can still overflow the parameter's dtype."""
    if not bool(torch.isfinite(updated).all()):
        raise NonFiniteError(f"{method}: the update of {name} would make it non-finite ({updated.dtype} "
                             "overflow); no weight was changed")


def require_finite_gradients(params: dict[str, nn.Parameter], method: str) -> None:
    """Before a general optimizer's step: every .grad the method set is finite, or all of them are
    cleared (so no optimizer ever sees them) and NonFiniteError names the first bad one."""
    for name, param in params.items():
        if param.grad is not None and not bool(torch.isfinite(param.grad).all()):
            for other in params.values():
                other.grad = None
            raise NonFiniteError(f"{method}: non-finite gradient estimate for {name}; no weight was changed")


PLAIN_SGD_TYPES = (torch.optim.SGD, eager_optimizers.SGD)


def plain_sgd_learning_rates(optimizer: torch.optim.Optimizer) -> dict[int, float] | None:
    """{id(param): lr} when every group is SGD without momentum, weight decay, maximize or the fused
    kernel (the update is then p - lr * grad, no state, and can be applied in place); None otherwise."""
    if type(optimizer) not in PLAIN_SGD_TYPES:  # a subclass may change what step does
        return None
    rates = {}
    for group in optimizer.param_groups:
        if group["momentum"] != 0 or group["weight_decay"] != 0 or group.get("maximize", False) \
                or group.get("fused", False):
            return None
        for param in group["params"]:
            rates[id(param)] = float(group["lr"])
    return rates


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
