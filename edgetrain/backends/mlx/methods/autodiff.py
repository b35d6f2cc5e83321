"""`bp` (mx.value_and_grad through the whole model) and `mebp` (each block under mx.checkpoint, so
only block inputs are kept in the forward and one block is re-run at a time in the backward) on MLX.

Both give exact gradients; as on torch, `mebp` is the MeSP paper's MeBP baseline: autodiff still
decides what a recomputed block keeps.
"""
from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from edgetrain.backends.mlx.lora import trainable_parameters
from edgetrain.backends.mlx.methods.common import MLX_METHODS, lm_loss, no_options, require_lm


def full_forward(model: nn.Module, inputs: mx.array) -> mx.array:
    return model(inputs)


def checkpointed_forward(model: nn.Module, inputs: mx.array) -> mx.array:
    h = model.embed(inputs)
    for block, rope in zip(model.blocks, model.block_ropes(h.shape[1], h.dtype)):
        def run(params: dict, hidden: mx.array, block: nn.Module = block, rope: tuple = rope) -> mx.array:
            block.update(params)
            return block(hidden, rope)

        h = mx.checkpoint(run)(block.trainable_parameters(), h)
    return model.logits(h)


class Autodiff:
    # Its step is its gradients and one optimizer update: the learner may accumulate and clip them.
    gradient_step = True

    def __init__(self, name: str, model: nn.Module, forward: Callable[[nn.Module, mx.array], mx.array],
                 **options: Any) -> None:
        no_options(name, options)
        require_lm(model, name)
        self.name = name
        self.model = model
        self.forward = forward
        self.names = list(trainable_parameters(model))

        def loss_fn(inputs: mx.array, targets: mx.array) -> mx.array:
            return lm_loss(self.forward(self.model, inputs), targets)

        self._value_and_grad = nn.value_and_grad(model, loss_fn)

    def gradients(self, inputs: mx.array, targets: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
        loss, grads = self._value_and_grad(inputs, targets)
        grads = dict(tree_flatten(grads))
        mx.eval(loss, grads)
        return loss, grads

    def step(self, inputs: mx.array, targets: mx.array, optimizer: Any) -> mx.array:
        loss, grads = self.gradients(inputs, targets)
        optimizer.apply(grads)
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


MLX_METHODS.add("bp", lambda model, **options: Autodiff("bp", model, full_forward, **options))
MLX_METHODS.add("mebp", lambda model, **options: Autodiff("mebp", model, checkpointed_forward, **options))
