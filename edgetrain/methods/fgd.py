"""`fgd`: forward gradient descent (Baydin et al. 2022; AsyncFGD Eq. 3-5).

One forward pass per tangent carries, next to every activation h, its JVP o along a random Gaussian
tangent u of the trainable parameters (forward-mode AD with `torch.autograd.forward_ad` dual
tensors; `torch.func.jvp` refuses BatchNorm in train mode because it mutates running statistics).
The loss comes out with its directional derivative dL/du, and (dL/du) * u is an unbiased estimate
of the gradient. No graph is built and nothing is kept for a backward: the forward holds one unit's
input and its JVP at a time (a unit is the block view's embed, each block, and the head).

Tangents are never stored (see `tangents.py`): a unit's parameter tangents are drawn from their
seeds just before the unit runs and dropped after it; the update draws them again one parameter at a
time. With plain SGD (the default optimizer) the update is applied in place, parameter by parameter,
so no gradient-sized buffer exists at all. Other optimizers get the estimate in `.grad`; Adam works
but on forward gradients it tends to stall: its per-coordinate normalisation turns the estimate's
d-fold variance into steps of full size in random directions (the paper's convergence analysis is
for SGD, Algorithm 1), so prefer SGD with a smaller learning rate.

Options (Learner(method_options=...)):
  seed               -- run seed of the tangents (default 0)
  alpha              -- tangent scale: a number, or {parameter-name prefix: number}; 0 freezes
  num_tangents       -- tangents per step, their estimates averaged (variance / num_tangents)
  tangent_checkpoint -- False keeps each tangent from forward to update (memory comparison only)
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch.func import functional_call

from edgetrain.data.batch import Batch
from edgetrain.training.losses import task_loss
from edgetrain.methods.base import (METHODS, NonFiniteError, plain_sgd_learning_rates, require_finite,
                                    require_finite_gradients, require_finite_update, require_step_fits,
                                    trainable_parameters)
from edgetrain.methods.options import flag_option, int_option, positive_int_option
from edgetrain.methods.tangents import AlphaSpec, TangentBank, TangentKey, resolve_alpha
from edgetrain.registry import EdgetrainError


@dataclass
class Unit:
    """One piece of the block view the forward runs as a whole: embed, one block, or the head."""

    name: str
    module: nn.Module
    # (name inside the unit, canonical model name) of every trainable parameter the unit uses;
    # a tied parameter appears under each of its names, all with the same canonical name.
    parameters: list[tuple[str, str]]


def block_units(model: nn.Module) -> list[Unit]:
    """embed, blocks.0 .. blocks.N-1, head -- or the whole model as one unit when it has no block view."""
    trainable = trainable_parameters(model)
    canonical = {id(p): name for name, p in trainable.items()}
    if all(hasattr(model, a) for a in ("embed", "blocks", "head")):
        pieces = [("embed", model.embed)] + [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
        pieces.append(("head", model.head))
    else:
        pieces = [("", model)]
    units, covered = [], set()
    for name, module in pieces:
        params = [(rel, canonical[id(p)]) for rel, p in module.named_parameters(remove_duplicate=False)
                  if id(p) in canonical]
        covered.update(c for _, c in params)
        units.append(Unit(name, module, params))
    missing = sorted(set(trainable) - covered)
    if missing:
        raise EdgetrainError(f"{type(model).__name__}: trainable parameters outside embed/blocks/head "
                             f"({', '.join(missing[:3])}...) would never be perturbed; forward gradients "
                             "need every trainable parameter inside the block view")
    return units


class SharedDualLevel:
    """A forward-AD dual level shared by every thread that is inside one.

    torch keeps dual levels process-wide and refuses a second one ("Nested forward mode AD is not
    supported"), so AsyncFGD's workers cannot each open their own. The first thread in opens the
    level, the last one out closes it; threads in between use the open one (make_dual/unpack_dual
    at the current level). Tangents are unpacked inside, so closing the level loses nothing.
    Code outside these methods that opens a dual level of its own while a step runs would collide."""

    _lock = threading.Lock()
    _users = 0

    def __enter__(self) -> "SharedDualLevel":
        with SharedDualLevel._lock:
            if SharedDualLevel._users == 0:
                fwAD.enter_dual_level()
            SharedDualLevel._users += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        with SharedDualLevel._lock:
            SharedDualLevel._users -= 1
            if SharedDualLevel._users == 0:
                fwAD.exit_dual_level()


class ForwardStage:
    """A contiguous run of units (module k of a pipeline; the whole model for `fgd`): forward with
    JVPs along the seeded tangents of its own parameters, and the update of those parameters."""

    def __init__(self, index: int, units: Sequence[Unit], params: dict[str, nn.Parameter],
                 bank: TangentBank, seed: int, num_tangents: int, model: nn.Module, is_last: bool,
                 method: str = "fgd") -> None:
        self.index = index
        self.method = method  # for messages
        self.units = list(units)
        self.bank = bank
        self.seed = seed
        self.num_tangents = num_tangents
        self.model = model
        self.is_last = is_last
        names = []
        for unit in self.units:
            names += [c for _, c in unit.parameters if c not in names]
        self.params = {name: params[name] for name in names}

    def key(self, sample: int, draw: int) -> TangentKey:
        return TangentKey(self.seed, sample, self.index, draw)

    @torch.no_grad()
    def forward(self, sample: int, h: torch.Tensor,
                jvps: list[torch.Tensor | None]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """(activation, one JVP per tangent; None = zero) in -> the same after this stage."""
        for unit in self.units:
            perturbed = [(rel, c) for rel, c in unit.parameters if self.bank.perturbed(c)]
            if not perturbed and all(o is None for o in jvps):
                h = unit.module(h)  # nothing perturbed so far: a plain forward
                continue
            kept_buffers = None
            next_h, next_jvps = None, []
            for draw, o in enumerate(jvps):
                if not perturbed and o is None:
                    next_jvps.append(None)
                    continue
                if next_h is not None and kept_buffers is None:
                    # Every tangent re-runs the unit on the same input; BatchNorm must update its
                    # running statistics once per step, not once per tangent.
                    kept_buffers = [b.clone() for b in unit.module.buffers()]
                next_h, tangent = self._dual_forward(unit, perturbed, sample, draw, h, o)
                next_jvps.append(tangent)
                if kept_buffers:
                    for buffer, kept in zip(unit.module.buffers(), kept_buffers):
                        buffer.copy_(kept)
            h, jvps = next_h if next_h is not None else unit.module(h), next_jvps
        return h, jvps

    def _dual_forward(self, unit: Unit, perturbed: list[tuple[str, str]], sample: int, draw: int,
                      h: torch.Tensor, o: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        key = self.key(sample, draw)
        with SharedDualLevel():
            duals: dict[str, torch.Tensor] = {}
            by_name: dict[str, torch.Tensor] = {}
            for rel, name in perturbed:
                if name not in by_name:  # a tied parameter gets one tangent under all its names
                    param = self.params[name]
                    by_name[name] = fwAD.make_dual(param.detach(), self.bank.for_forward(key, name, param))
                duals[rel] = by_name[name]
            x = h if o is None else fwAD.make_dual(h, o)
            out = functional_call(unit.module, duals, (x,), strict=False) if duals else unit.module(x)
            primal, tangent = fwAD.unpack_dual(out)
        return primal, tangent

    @torch.no_grad()
    def loss_derivatives(self, outputs: torch.Tensor, jvps: list[torch.Tensor | None],
                         targets: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        """The loss and its directional derivative along each tangent (the last stage's job)."""
        loss, derivatives = None, []
        for o in jvps:
            if o is None:
                derivatives.append(0.0)
                continue
            with SharedDualLevel():
                primal, tangent = fwAD.unpack_dual(task_loss(self.model, fwAD.make_dual(outputs, o), targets))
            loss = primal
            derivatives.append(float(tangent))
        if loss is None:
            loss = task_loss(self.model, outputs, targets)
        return loss.detach(), derivatives

    @torch.no_grad()
    def check_update(self, sample: int, derivatives: Sequence[float], learning_rates: dict[int, float]) -> None:
        """NonFiniteError unless every weight `update_in_place` would write is finite. Each parameter's
        new value is computed exactly as the update computes it, into a temporary that is dropped, so
        nothing is written and no more than one parameter's worth of memory is used; kept tangents
        stay kept."""
        n = len(derivatives)
        for name, param in self.params.items():
            if not self.bank.perturbed(name):
                continue
            lr = learning_rates[id(param)]
            updated = param
            for draw, derivative in enumerate(derivatives):
                step = -lr * derivative / n
                require_step_fits(step, param, name, self.method)
                tangent = self.bank.for_update(self.key(sample, draw), name, param, consume=False)
                updated = torch.add(updated, tangent, alpha=step) if updated is param \
                    else updated.add_(tangent, alpha=step)
            require_finite_update(updated, name, self.method)

    @torch.no_grad()
    def update_in_place(self, sample: int, derivatives: Sequence[float], learning_rates: dict[int, float]) -> None:
        """w -= lr * mean_j (dL/du_j) u_j, one parameter and one tangent at a time. Callers run
        `check_update` of every stage first: this writes without checking."""
        n = len(derivatives)
        for name, param in self.params.items():
            if not self.bank.perturbed(name):
                continue
            lr = learning_rates[id(param)]
            for draw, derivative in enumerate(derivatives):
                tangent = self.bank.for_update(self.key(sample, draw), name, param)
                param.add_(tangent, alpha=-lr * derivative / n)

    @torch.no_grad()
    def estimate(self, sample: int, derivatives: Sequence[float]) -> dict[str, torch.Tensor]:
        """mean_j (dL/du_j) u_j for every perturbed parameter (alpha = 0 ones are left out)."""
        n = len(derivatives)
        grads = {}
        for name, param in self.params.items():
            if not self.bank.perturbed(name):
                continue
            grad = None
            for draw, derivative in enumerate(derivatives):
                tangent = self.bank.for_update(self.key(sample, draw), name, param).mul_(derivative / n)
                grad = tangent if grad is None else grad.add_(tangent)
            grads[name] = grad
        return grads

    def set_gradients(self, sample: int, derivatives: Sequence[float]) -> None:
        """Put the estimate in .grad for a general optimizer (alpha = 0 parameters keep grad None,
        so the optimizer leaves them alone)."""
        for name, grad in self.estimate(sample, derivatives).items():
            self.params[name].grad = grad

    def refill_kept_tangents(self, sample: int) -> None:
        """After a resume without tangent checkpointing: keep again the tangents of an in-flight sample."""
        for draw in range(self.num_tangents):
            for name, param in self.params.items():
                if self.bank.perturbed(name):
                    self.bank.keep_again(self.key(sample, draw), name, param)

    def release(self, sample: int) -> None:
        for draw in range(self.num_tangents):
            self.bank.release(self.key(sample, draw))


def check_forward_gradient_options(name: str, seed: Any, num_tangents: Any) -> tuple[int, int]:
    num_tangents = positive_int_option(name, "num_tangents", num_tangents)
    return int_option(name, "seed", seed), num_tangents


def make_tangent_bank(name: str, params: dict[str, nn.Parameter], alpha: AlphaSpec,
                      tangent_checkpoint: bool) -> TangentBank:
    try:
        alphas = resolve_alpha(alpha, params)
    except EdgetrainError as error:
        raise EdgetrainError(f"{name}: {error}") from None
    if not any(alphas.values()):
        raise EdgetrainError(f"{name}: alpha is 0 for every trainable parameter; nothing would train")
    return TangentBank({n: i for i, n in enumerate(params)}, alphas,
                       checkpoint=flag_option(name, "tangent_checkpoint", tangent_checkpoint))


def check_updates(stages: Sequence[ForwardStage], sample: int, derivatives: Sequence[float],
                  learning_rates: dict[int, float]) -> NonFiniteError | None:
    """The refusal of the first stage whose in-place update would write a non-finite weight, or None."""
    try:
        for stage in stages:
            stage.check_update(sample, derivatives, learning_rates)
    except NonFiniteError as refusal:
        return refusal
    return None


def apply_estimate(stages: Sequence[ForwardStage], sample: int, derivatives: Sequence[float],
                   optimizer: torch.optim.Optimizer, params: dict[str, nn.Parameter], method: str) -> None:
    """Update every stage's parameters with the forward-gradient estimate of `sample`, all or nothing:
    a non-finite new weight (in place) or gradient estimate (other optimizers) raises NonFiniteError
    before anything is written."""
    rates = plain_sgd_learning_rates(optimizer)
    if rates is not None:
        refusal = check_updates(stages, sample, derivatives, rates)
        if refusal is not None:
            raise refusal
        for stage in stages:
            stage.update_in_place(sample, derivatives, rates)
        return
    for stage in stages:
        stage.set_gradients(sample, derivatives)
    require_finite_gradients(params, method)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class ForwardGradient:
    name = "fgd"

    def __init__(self, model: nn.Module, seed: int = 0, alpha: AlphaSpec = 1.0, num_tangents: int = 1,
                 tangent_checkpoint: bool = True) -> None:
        self.seed, self.num_tangents = check_forward_gradient_options(self.name, seed, num_tangents)
        self.model = model
        self.params = trainable_parameters(model)
        self.alpha_spec = alpha
        self.bank = make_tangent_bank(self.name, self.params, alpha, tangent_checkpoint)
        # One stage over the whole model: exactly module 0 of a one-module AsyncFGD pipeline.
        self.stage = ForwardStage(0, block_units(model), self.params, self.bank, self.seed, self.num_tangents,
                                  model, is_last=True)
        self.steps_taken = 0

    def set_alpha(self, alpha: AlphaSpec) -> None:
        """Change the tangent scales (e.g. the paper's gradual alpha ramp); takes effect at the next step."""
        self.bank.alpha = resolve_alpha(alpha, self.params)
        self.alpha_spec = alpha

    def loss_and_derivatives(self, batch: Batch, sample: int) -> tuple[torch.Tensor, list[float]]:
        outputs, jvps = self.stage.forward(sample, batch.inputs, [None] * self.num_tangents)
        loss, derivatives = self.stage.loss_derivatives(outputs, jvps, batch.targets)
        require_finite(float(loss), "loss")
        for derivative in derivatives:
            require_finite(derivative, "directional derivative")
        return loss, derivatives

    def gradients(self, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss and the forward-gradient estimate (zeros for alpha = 0 parameters), drawn with
        the tangents the next step will use; weights and counters unchanged."""
        sample = self.steps_taken
        try:
            loss, derivatives = self.loss_and_derivatives(batch, sample)
        except Exception:
            self.stage.release(sample)
            raise
        estimate = self.stage.estimate(sample, derivatives)
        return loss, {name: estimate.get(name, torch.zeros_like(p)) for name, p in self.params.items()}

    def step(self, batch: Batch, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        sample = self.steps_taken
        try:
            loss, derivatives = self.loss_and_derivatives(batch, sample)
            apply_estimate([self.stage], sample, derivatives, optimizer, self.params, self.name)
        except Exception:
            # Nothing was written: the counter stays, so a retry draws the same tangents.
            self.stage.release(sample)
            raise
        self.steps_taken += 1
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "steps_taken": self.steps_taken, "num_tangents": self.num_tangents,
                "alpha": self.alpha_spec}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["num_tangents"]) != self.num_tangents:
            raise EdgetrainError(f"fgd: checkpoint has num_tangents={state['num_tangents']}, "
                                 f"this learner {self.num_tangents}")
        self.seed = self.stage.seed = int(state["seed"])
        self.steps_taken = int(state["steps_taken"])
        self.set_alpha(state["alpha"])


METHODS.add("fgd", ForwardGradient)
