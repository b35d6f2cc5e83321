"""`mezo` on MLX: zeroth-order SPSA (Malladi et al. 2023) with the seed trick, as edgetrain.methods.mezo.

Two forwards at theta +/- eps z give the directional derivative along a Gaussian z; the update is
-lr * that * z. z is never stored: each parameter's slice is regenerated from a key split off the
step's seed, so only one parameter's z exists at a time.
"""
from __future__ import annotations

from typing import Any, Iterator

import mlx.core as mx
import mlx.nn as nn

from edgetrain.backends.mlx.lora import set_parameters, trainable_parameters
from edgetrain.backends.mlx.methods.common import MLX_METHODS, lm_loss, require_lm
from edgetrain.methods.base import require_finite
from edgetrain.methods.configs import method_config


class ZerothOrder:
    name = "mezo"

    def __init__(self, model: nn.Module, **options: Any) -> None:
        config = method_config("mezo", options)  # the options torch's mezo takes too (methods/configs.py)
        require_lm(model, "mezo")
        self.model = model
        self.names = list(trainable_parameters(model))
        self.epsilon, self.seed = config.epsilon, config.seed
        self.steps_taken = 0

    def _step_seed(self) -> int:
        # Keyed by (seed, step) so that a resumed run regenerates exactly the same perturbations.
        return (self.seed * 1_000_003 + self.steps_taken) % (2**63 - 1)

    def _directions(self, seed: int) -> Iterator[tuple[str, mx.array]]:
        """(name, z) one parameter at a time, z ~ N(0, 1) from the name's own key."""
        keys = mx.random.split(mx.random.key(seed), len(self.names))
        params = trainable_parameters(self.model)
        for index, name in enumerate(self.names):
            yield name, mx.random.normal(params[name].shape, dtype=params[name].dtype, key=keys[index])

    def _perturb(self, seed: int, scale: float) -> None:
        # One parameter at a time, evaluated at once, so that only one z is ever alive.
        for name, z in self._directions(seed):
            value = trainable_parameters(self.model)[name] + scale * z
            mx.eval(value)
            set_parameters(self.model, {name: value})

    def _loss(self, inputs: mx.array, targets: mx.array) -> mx.array:
        # Block by block, each output evaluated at once: inference memory is one block's working
        # set (left as one lazy graph, MLX may materialise many blocks' temporaries together).
        model = self.model
        hidden = model.embed(inputs)
        for block, rope in zip(model.blocks, model.block_ropes(hidden.shape[1], hidden.dtype)):
            hidden = block(hidden, rope)
            mx.eval(hidden)
        loss = lm_loss(model.logits(hidden), targets)
        mx.eval(loss)
        return loss

    def projected_gradient(self, inputs: mx.array, targets: mx.array, seed: int) -> tuple[mx.array, float]:
        """(loss at theta, (L(theta + eps z) - L(theta - eps z)) / 2 eps); weights restored after."""
        self._perturb(seed, self.epsilon)
        loss_plus = self._loss(inputs, targets)
        self._perturb(seed, -2 * self.epsilon)
        loss_minus = self._loss(inputs, targets)
        self._perturb(seed, self.epsilon)
        projected = float((loss_plus - loss_minus) / (2 * self.epsilon))
        require_finite(float(loss_plus), "loss at theta + eps z")
        require_finite(float(loss_minus), "loss at theta - eps z")
        require_finite(projected, "projected gradient")
        return (loss_plus + loss_minus) / 2, projected

    def gradients(self, inputs: mx.array, targets: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
        seed = self._step_seed()
        # The +eps/-2eps/+eps walk restores the weights only up to rounding; this diagnostic path
        # promises unchanged weights (arrays are immutable: keeping the old ones is the copy).
        saved = trainable_parameters(self.model)
        loss, projected = self.projected_gradient(inputs, targets, seed)
        set_parameters(self.model, saved)
        grads = {name: z * projected for name, z in self._directions(seed)}
        mx.eval(grads)
        return loss, grads

    def step(self, inputs: mx.array, targets: mx.array, optimizer: Any) -> mx.array:
        seed = self._step_seed()
        loss, projected = self.projected_gradient(inputs, targets, seed)
        if optimizer.is_plain_sgd():
            # The memory-lean path of the paper: update parameter by parameter, regenerating z.
            self._perturb(seed, -optimizer.learning_rate * projected)
        else:
            optimizer.apply({name: z * projected for name, z in self._directions(seed)})
        self.steps_taken += 1
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "steps_taken": self.steps_taken}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self.steps_taken = int(state["steps_taken"])


MLX_METHODS.add("mezo", ZerothOrder)
