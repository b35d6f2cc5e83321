"""Optimizers by name. A method may apply them per block (MeSP's fused update), so only torch's own
optimizers, which skip parameters whose .grad is None, are listed: torch's classes without their
torch._dynamo import (eager_optimizers), bit-equal to torch.optim's."""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from edgetrain.backends.torch import eager_optimizers
from edgetrain.registry import Registry

OPTIMIZERS: Registry[Callable[..., torch.optim.Optimizer]] = Registry("optimizer")
OPTIMIZERS.add("sgd", lambda params, lr, **kw: eager_optimizers.SGD(params, lr=lr, **kw))
OPTIMIZERS.add("adam", lambda params, lr, **kw: eager_optimizers.Adam(params, lr=lr, **kw))
OPTIMIZERS.add("adamw", lambda params, lr, **kw: eager_optimizers.AdamW(params, lr=lr, **kw))


def make_optimizer(spec: str | Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer],
                   params: list[torch.nn.Parameter], lr: float, **options) -> torch.optim.Optimizer:
    if isinstance(spec, str):
        return OPTIMIZERS.get(spec)(params, lr, **options)
    return spec(params)
