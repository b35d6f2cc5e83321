"""All-or-nothing optimizer steps: a step that meets a non-finite gradient, or whose result would not be
finite, changes neither the weights nor the optimizer state (NonFiniteError). Installed by the learner on
its optimizer as step hooks, so the per-block steps of fused methods are covered as well."""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from edgetrain.backends.torch import eager_optimizers
from edgetrain.methods.base import NonFiniteError, plain_sgd_learning_rates, require_finite_update, require_step_fits


class FiniteOptimizerSteps:
    """Makes every `optimizer.step()` all or nothing (step hooks, so methods that step per block are
    covered too): a non-finite gradient is refused before the step, and so is a step whose result
    would be non-finite (a finite gradient can still overflow the weights' dtype) -- NonFiniteError,
    with the weights and the optimizer state exactly as before the step.

    How the result is checked depends on the optimizer. Plain SGD (no momentum, weight decay, maximize
    or fused kernel) keeps no state and writes p - lr * grad: that value is computed for one parameter
    at a time into a temporary and checked before the step, so no copy of the weights is kept.
    edgetrain's own optimizers (eager_optimizers, what the learner builds by name) run their step on
    copies of one parameter and its state at a time (`trial_update`, the same arithmetic), so the whole
    step is checked before anything changes while only one parameter's copy is held: for Adam on LoRA
    that is three adapter-sized copies fewer at the step's peak. Any other optimizer's result cannot be
    known without running it: the parameters being stepped (those with a .grad) and their optimizer
    state are copied before the step, checked after it and put back if any came out non-finite. The copy
    lives only during optimizer.step(), after the backward has freed the activations.

    A result counts as non-finite when the weight or any of its optimizer state does: Adam's second
    moment overflows (grad**2 past the dtype's range) while the weight itself stays finite, and would
    then freeze that weight for good."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: dict[str, nn.Parameter]) -> None:
        self.names = {id(p): name for name, p in params.items()}
        self.kept: list[tuple[nn.Parameter, torch.Tensor, dict[str, Any] | None]] | None = None
        optimizer.register_step_pre_hook(self.before)
        optimizer.register_step_post_hook(self.after)

    def _name(self, param: torch.Tensor) -> str:
        return self.names.get(id(param), f"a parameter of shape {tuple(param.shape)}")

    @torch.no_grad()
    def before(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.kept = None
        stepped = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not all_finite([param.grad for param in stepped]):
            bad = next(param for param in stepped if not bool(torch.isfinite(param.grad).all()))
            raise NonFiniteError(f"non-finite gradient for {self._name(bad)}")
        rates = plain_sgd_learning_rates(optimizer)
        if rates is not None:
            for param in stepped:
                require_step_fits(-rates[id(param)], param, self._name(param), "sgd")
            updated = _sgd_results(stepped, rates)
            if not all_finite(updated):
                for param, value in zip(stepped, updated):
                    require_finite_update(value, self._name(param), "sgd")
            return
        if isinstance(optimizer, eager_optimizers.EagerStep) and optimizer.plain():
            # Each trial's largest magnitude is kept (a number, not the trial's copies), all read at once.
            maxima = [_largest_magnitude(*optimizer.trial_update(param)) for param in stepped]
            flags = torch.isfinite(_stacked(maxima)) if maxima else None
            if flags is not None and not bool(flags.all()):
                param = stepped[int((~flags).nonzero()[0, 0])]
                raise NonFiniteError(f"{type(optimizer).__name__}: the update of {self._name(param)} came out "
                                     f"non-finite ({param.dtype} overflow) when tried on a copy; no weight "
                                     "or optimizer state was changed")
            return
        self.kept = [(p, p.detach().clone(), _copy_state(optimizer.state.get(p))) for p in stepped]

    @torch.no_grad()
    def after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        kept, self.kept = self.kept, None
        if not kept:
            return
        bad = next((p for p, _, _ in kept if not _finite(p, optimizer.state.get(p, {}))), None)
        if bad is None:
            return
        self._put_back(optimizer, kept)
        raise NonFiniteError(f"{type(optimizer).__name__}: the update of {self._name(bad)} came out non-finite "
                             f"({bad.dtype} overflow); the weights and optimizer state were put back")

    def put_back_interrupted(self, optimizer: torch.optim.Optimizer) -> None:
        """After an exception: a step that raised half-way (the post-hook never ran) is undone too."""
        kept, self.kept = self.kept, None
        if kept:
            self._put_back(optimizer, kept)

    @staticmethod
    @torch.no_grad()
    def _put_back(optimizer: torch.optim.Optimizer,
                  kept: list[tuple[nn.Parameter, torch.Tensor, dict[str, Any] | None]]) -> None:
        for param, value, state in kept:
            param.copy_(value)
            if state is None:
                optimizer.state.pop(param, None)
            else:
                optimizer.state[param] = state


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every entry of every tensor is finite, in one reading for all of them: each tensor's largest
    magnitude (NaN or infinite exactly when one of its entries is), stacked. A step's per-parameter checks were
    a handful of operators and a read each: about 2,500 operators a step for SmolLM2's 420 adapter tensors."""
    floating = [t for t in tensors if (t.is_floating_point() or t.is_complex()) and t.numel()]
    if not floating:
        return True
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in floating:
        by_device.setdefault(tensor.device, []).append(tensor)
    return all(bool(torch.isfinite(torch.stack(torch._foreach_norm(group, float("inf")))).all())
               for group in by_device.values())


def _sgd_results(params: list[torch.Tensor], rates: dict[int, float]) -> list[torch.Tensor]:
    """p - lr * grad for each parameter, into new tensors (the weights untouched), a foreach call a rate."""
    by_rate: dict[float, list[int]] = {}
    for index, param in enumerate(params):
        by_rate.setdefault(rates[id(param)], []).append(index)
    results: list[torch.Tensor | None] = [None] * len(params)
    for rate, indices in by_rate.items():
        values = torch._foreach_add([params[i].detach() for i in indices], [params[i].grad for i in indices],
                                    alpha=-rate)
        for index, value in zip(indices, values):
            results[index] = value
    return results


def _largest_magnitude(value: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
    """The largest magnitude among a weight and its optimizer state, a scalar tensor on the weight's device: NaN or
    infinite exactly when one of their entries is (amax keeps a NaN)."""
    tensors = [t for t in (value, *state.values()) if isinstance(t, torch.Tensor) and t.is_floating_point()
               and t.numel() and t.device == value.device]
    others = [t for t in state.values() if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()
              and t.device != value.device]  # a state on another device (Adam's step count may sit on the CPU)
    if not tensors:
        return torch.zeros((), device=value.device)
    largest = torch.stack(torch._foreach_norm(tensors, float("inf"))).amax()
    if others and not all(bool(torch.isfinite(t).all()) for t in others):
        return largest.new_full((), float("nan"))
    return largest


def _stacked(scalars: list[torch.Tensor]) -> torch.Tensor:
    """Scalars of any float dtype, on one device (the first one's) where they sit on several."""
    device = scalars[0].device
    return torch.stack([s if s.device == device else s.to(device) for s in scalars])


def _finite(value: torch.Tensor, state: dict[str, Any]) -> bool:
    tensors = [value, *(item for item in state.values() if isinstance(item, torch.Tensor))]
    return all(bool(torch.isfinite(tensor).all()) for tensor in tensors if tensor.is_floating_point())


def _copy_state(state: dict[str, Any] | None) -> dict[str, Any] | None:
    if not state:
        return None
    return {key: value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
            for key, value in state.items()}
