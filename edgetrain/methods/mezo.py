"""`mezo`: zeroth-order SPSA (Malladi et al. 2023) with the seed trick.

Two forwards at theta +/- eps*z give the directional derivative along a random Gaussian z; the
update is -lr * that * z. z is never stored: it is regenerated, parameter by parameter, from the
step's seed, so the method needs no more memory than inference.

Options (Learner(method_options=...)): epsilon -- the perturbation scale (default 1e-3); seed -- the run
seed of the perturbations (default 0; step k draws z from a seed made of (seed, k)).

z is drawn as documented: one generator per device seeded with the step's seed, one N(0, I) draw
per trainable parameter in the model's order. The generator's state before each draw is remembered
(a few kB per parameter), so any parameter's z can be drawn again on its own, in any order.

The weights are never perturbed in place. The forward at theta + eps z runs the model's block view
(embed, blocks, head) one unit at a time, each with its own parameters replaced by perturbed
temporaries (torch.func.functional_call); theta - eps z is reached as the paper's walk reaches it,
(theta + eps z) - 2 eps z, computed the same way. So theta is bit-for-bit intact whatever happens
during the forwards (a non-finite loss, an exception), and the extra memory is one unit's trainable
parameters, not a copy of the model. A model without a block view runs as a single unit (its
perturbed trainable parameters then exist all at once).

The update is all-or-nothing: with plain SGD every parameter's new value is first computed into a
temporary and checked finite (a finite lr * g times a finite z can still overflow float16), then,
only if all are, written in place; with any other optimizer g * z goes to .grad after a finiteness
check. A failed step raises NonFiniteError and leaves weights, optimizer state and the step counter
as they were, so a retry draws the same z.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from edgetrain.data.batch import Batch
from edgetrain.training.losses import task_loss
from edgetrain.methods.base import (METHODS, plain_sgd_learning_rates, require_finite, require_finite_gradients,
                                    require_finite_update, require_step_fits, trainable_parameters)
from edgetrain.methods.fgd import Unit, block_units
from edgetrain.methods.configs import method_config
from edgetrain.registry import EdgetrainError


class Directions:
    """z for every trainable parameter of one step, available by name in any order (see the module
    docstring): the sequential draws are made once, the generator state before each is kept."""

    def __init__(self, params: dict[str, nn.Parameter], seed: int) -> None:
        self.params = params
        self.seed = seed
        self._order = list(params)
        self._drawn = 0  # parameters [0, _drawn) have their state recorded
        self._generators: dict[torch.device, torch.Generator] = {}
        self._states: dict[str, torch.Tensor] = {}

    def __call__(self, name: str) -> torch.Tensor:
        param = self.params[name]
        if name in self._states:
            generator = torch.Generator(device=param.device)
            generator.set_state(self._states[name])
            return _draw(param, generator)
        while True:  # advance the sequential draws up to `name`
            current = self._order[self._drawn]
            target = self.params[current]
            generator = self._generators.get(target.device)
            if generator is None:
                generator = self._generators[target.device] = \
                    torch.Generator(device=target.device).manual_seed(self.seed)
            self._states[current] = generator.get_state()
            self._drawn += 1
            z = _draw(target, generator)
            if current == name:
                return z


def _draw(param: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(param.shape, generator=generator, device=param.device, dtype=param.dtype)


def mezo_units(model: nn.Module, params: dict[str, nn.Parameter]) -> list[Unit]:
    """The block view's units, or the whole model as one unit when it has none."""
    try:
        return block_units(model)
    except EdgetrainError:
        pass  # trainable parameters outside embed/blocks/head: perturb the whole model at once
    canonical = {id(p): name for name, p in params.items()}
    return [Unit("", model, [(rel, canonical[id(p)]) for rel, p in model.named_parameters(remove_duplicate=False)
                             if id(p) in canonical])]


class ZerothOrder:
    name = "mezo"

    def __init__(self, model: nn.Module, **options: Any) -> None:
        config = method_config("mezo", options)  # the options MLX's mezo takes too (methods/configs.py)
        self.epsilon, self.seed = config.epsilon, config.seed
        self.model = model
        self.params = trainable_parameters(model)
        # theta + eps z is computed in the parameters' dtype: an epsilon it cannot hold is refused here
        # rather than failing inside torch at the first step.
        for name, param in self.params.items():
            if param.is_floating_point() and self.epsilon > torch.finfo(param.dtype).max:
                raise EdgetrainError(f"mezo: epsilon {self.epsilon!r} is beyond what {name}'s {param.dtype} holds "
                                     f"({torch.finfo(param.dtype).max:.3g})")
        self.units = mezo_units(model, self.params)
        self.steps_taken = 0

    def _step_seed(self) -> int:
        # Keyed by (seed, step) so that a resumed run regenerates exactly the same perturbations.
        return (self.seed * 1_000_003 + self.steps_taken) % (2**63 - 1)

    def _perturbed(self, name: str, directions: Directions, sign: int) -> torch.Tensor:
        """theta + eps z (sign +1) or (theta + eps z) - 2 eps z (sign -1), as a new tensor."""
        param, z = self.params[name], directions(name)
        value = torch.add(param, z, alpha=self.epsilon)
        if sign < 0:
            value.add_(z, alpha=-2 * self.epsilon)
        return value

    def _loss_at(self, batch: Batch, directions: Directions, sign: int) -> torch.Tensor:
        """Called under projected_gradient's no_grad: no autograd graph, inference memory."""
        h = batch.inputs
        for unit in self.units:
            perturbed: dict[str, torch.Tensor] = {}
            weights = {}
            for rel, name in unit.parameters:
                if name not in perturbed:  # a tied parameter gets one value under all its names
                    perturbed[name] = self._perturbed(name, directions, sign)
                weights[rel] = perturbed[name]
            h = functional_call(unit.module, weights, (h,), strict=False) if weights else unit.module(h)
            del perturbed, weights  # only one unit's perturbed parameters exist at a time
        return task_loss(self.model, h, batch.targets)

    @torch.no_grad()
    def projected_gradient(self, batch: Batch, seed: int | Directions) -> tuple[torch.Tensor, float]:
        """(loss at theta, (L(theta + eps z) - L(theta - eps z)) / 2 eps); the weights are not touched."""
        directions = seed if isinstance(seed, Directions) else Directions(self.params, seed)
        loss_plus = self._loss_at(batch, directions, +1)
        require_finite(float(loss_plus), "loss at theta + eps z")
        loss_minus = self._loss_at(batch, directions, -1)
        require_finite(float(loss_minus), "loss at theta - eps z")
        projected = float((loss_plus - loss_minus) / (2 * self.epsilon))
        require_finite(projected, "projected gradient")
        return (loss_plus + loss_minus) / 2, projected

    def gradients(self, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        directions = Directions(self.params, self._step_seed())
        loss, projected = self.projected_gradient(batch, directions)
        return loss, {name: directions(name).mul_(projected) for name in self.params}

    def step(self, batch: Batch, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        directions = Directions(self.params, self._step_seed())
        loss, projected = self.projected_gradient(batch, directions)
        rates = plain_sgd_learning_rates(optimizer)
        if rates is not None:
            self._update_in_place(directions, projected, rates)
        else:
            for name, param in self.params.items():
                param.grad = directions(name).mul_(projected)
            require_finite_gradients(self.params, "mezo")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        self.steps_taken += 1
        return loss

    @torch.no_grad()
    def _update_in_place(self, directions: Directions, projected: float, rates: dict[int, float]) -> None:
        """The memory-lean path of the paper: theta -= lr * g * z, z regenerated per parameter. Every
        new value is checked (one temporary at a time) before any is written."""
        scales = {}
        for name, param in self.params.items():
            scales[name] = -rates[id(param)] * projected
            require_step_fits(scales[name], param, name, "mezo")
            require_finite_update(torch.add(param, directions(name), alpha=scales[name]), name, "mezo")
        for name, param in self.params.items():
            param.add_(directions(name), alpha=scales[name])

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "steps_taken": self.steps_taken}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self.steps_taken = int(state["steps_taken"])


METHODS.add("mezo", ZerothOrder)
