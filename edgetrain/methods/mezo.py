"""`mezo`: zeroth-order SPSA (Malladi et al. 2023) with the seed trick.

Two forwards at theta +/- eps*z give the directional derivative along a random Gaussian z; the
update is -lr * that * z. z is never stored: it is regenerated, parameter by parameter, from the
step's seed, so the method needs no more memory than inference.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from edgetrain.data.batch import Batch
from edgetrain.losses import task_loss
from edgetrain.methods.base import METHODS, require_finite, trainable_parameters
from edgetrain.registry import EdgetrainError


class ZerothOrder:
    name = "mezo"

    def __init__(self, model: nn.Module, epsilon: float = 1e-3, seed: int = 0) -> None:
        if not epsilon > 0:
            raise EdgetrainError(f"mezo: epsilon must be positive, got {epsilon!r}")
        self.model = model
        self.params = trainable_parameters(model)
        self.epsilon = float(epsilon)
        self.seed = int(seed)
        self.steps_taken = 0

    def _step_seed(self) -> int:
        # Keyed by (seed, step) so that a resumed run regenerates exactly the same perturbations.
        return (self.seed * 1_000_003 + self.steps_taken) % (2**63 - 1)

    def _directions(self, seed: int):
        """Yield (param, z) one parameter at a time; only one z is alive at once."""
        generators: dict[torch.device, torch.Generator] = {}
        for param in self.params.values():
            gen = generators.get(param.device)
            if gen is None:
                gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            yield param, torch.randn(param.shape, generator=gen, device=param.device, dtype=param.dtype)

    @torch.no_grad()
    def _perturb(self, seed: int, scale: float) -> None:
        for param, z in self._directions(seed):
            param.add_(z, alpha=scale)

    @torch.no_grad()
    def _loss(self, batch: Batch) -> torch.Tensor:
        return task_loss(self.model, self.model(batch.inputs), batch.targets)

    @torch.no_grad()
    def projected_gradient(self, batch: Batch, seed: int) -> tuple[torch.Tensor, float]:
        """(loss at theta, (L(theta + eps z) - L(theta - eps z)) / 2 eps); weights restored after."""
        self._perturb(seed, self.epsilon)
        loss_plus = self._loss(batch)
        self._perturb(seed, -2 * self.epsilon)
        loss_minus = self._loss(batch)
        self._perturb(seed, self.epsilon)
        projected = float((loss_plus - loss_minus) / (2 * self.epsilon))
        require_finite(float(loss_plus), "loss at theta + eps z")
        require_finite(float(loss_minus), "loss at theta - eps z")
        require_finite(projected, "projected gradient")
        return (loss_plus + loss_minus) / 2, projected

    def gradients(self, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        seed = self._step_seed()
        # The +eps/-2eps/+eps walk restores the weights only up to rounding; this diagnostic path
        # promises unchanged weights, so it restores them from a copy.
        saved = {name: p.detach().clone() for name, p in self.params.items()}
        loss, projected = self.projected_gradient(batch, seed)
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(saved[name])
        names = list(self.params)
        return loss, {name: z * projected for name, (_, z) in zip(names, self._directions(seed))}

    def step(self, batch: Batch, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        seed = self._step_seed()
        loss, projected = self.projected_gradient(batch, seed)
        if _is_plain_sgd(optimizer):
            # The memory-lean path of the paper: update in place, regenerating z per parameter.
            lr = optimizer.param_groups[0]["lr"]
            with torch.no_grad():
                for param, z in self._directions(seed):
                    param.add_(z, alpha=-lr * projected)
        else:
            for param, z in self._directions(seed):
                param.grad = z.mul_(projected)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        self.steps_taken += 1
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "steps_taken": self.steps_taken}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self.steps_taken = int(state["steps_taken"])


def _is_plain_sgd(optimizer: torch.optim.Optimizer) -> bool:
    if type(optimizer) is not torch.optim.SGD or len(optimizer.param_groups) != 1:
        return False
    group = optimizer.param_groups[0]
    return group["momentum"] == 0 and group["weight_decay"] == 0 and not group.get("maximize", False)


METHODS.add("mezo", ZerothOrder)
