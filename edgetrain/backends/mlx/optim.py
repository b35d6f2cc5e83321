"""Optimizers for the MLX learner: mlx.optimizers' SGD / Adam / AdamW over the flat
{name: array} dict of trainable parameters, applied to all parameters at once or to one block's
(MeSP's fused per-block update). A non-finite gradient is refused before any weight changes."""
from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_map

from edgetrain.backends.mlx.lora import set_parameters, trainable_parameters
from edgetrain.methods.base import NonFiniteError
from edgetrain.registry import Registry

MLX_OPTIMIZERS: Registry[Callable[..., optim.Optimizer]] = Registry("mlx optimizer")
MLX_OPTIMIZERS.add("sgd", lambda lr, **kw: optim.SGD(learning_rate=lr, **kw))
MLX_OPTIMIZERS.add("adam", lambda lr, **kw: optim.Adam(learning_rate=lr, **kw))
MLX_OPTIMIZERS.add("adamw", lambda lr, **kw: optim.AdamW(learning_rate=lr, **kw))


class FlatOptimizer:
    """Applies an mlx.optimizers.Optimizer to a model's trainable parameters by flat name."""

    def __init__(self, model: nn.Module, spec: str | optim.Optimizer, lr: float, **options: Any) -> None:
        self.model = model
        self.optimizer = MLX_OPTIMIZERS.get(spec)(lr, **options) if isinstance(spec, str) else spec
        self.optimizer.init(trainable_parameters(model))
        mx.eval(self.optimizer.state)

    @property
    def learning_rate(self) -> float:
        return float(self.optimizer.learning_rate)

    def is_plain_sgd(self) -> bool:
        opt = self.optimizer
        return (type(opt) is optim.SGD and float(opt.momentum) == 0 and float(opt.weight_decay) == 0
                and not opt._schedulers)

    def apply(self, grads: dict[str, mx.array], advance_step: bool = True) -> None:
        """Update the parameters named in `grads`. advance_step=False leaves the step counter alone
        (the per-block calls of one fused step count as one step)."""
        finite = [mx.all(mx.isfinite(g)) for g in grads.values()]
        if not all(bool(f) for f in finite):
            raise NonFiniteError("non-finite gradient")
        params = trainable_parameters(self.model)
        step_before = self.optimizer.state["step"]
        updated = self.optimizer.apply_gradients(grads, {name: params[name] for name in grads})
        if not advance_step:
            self.optimizer.state["step"] = step_before
        set_parameters(self.model, updated)
        mx.eval(updated, self.optimizer.state)

    def state_snapshot(self) -> Any:
        # Arrays are immutable: copying the tree's containers is a full snapshot.
        return tree_map(lambda x: x, self.optimizer.state)

    def restore_snapshot(self, snapshot: Any) -> None:
        self.optimizer.state = tree_map(lambda x: x, snapshot)
