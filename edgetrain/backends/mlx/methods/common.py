"""What the MLX methods share: the registry, the method contract, the LM loss, batch conversion."""
from __future__ import annotations

from typing import Any, Callable, Protocol

import mlx.core as mx
import mlx.nn as nn

from edgetrain.registry import EdgetrainError, Registry
from edgetrain.training.losses import IGNORE_INDEX


class MLXMethod(Protocol):
    name: str

    def gradients(self, inputs: mx.array, targets: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
        """Loss and the gradient (or the method's estimate) per trainable parameter; weights unchanged."""

    def step(self, inputs: mx.array, targets: mx.array, optimizer: Any) -> mx.array:
        """One training step; returns the loss of the weights before the update."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# name -> constructor(model, **options)
MLX_METHODS: Registry[Callable[..., MLXMethod]] = Registry("mlx method")


def lm_loss(logits: mx.array, targets: mx.array) -> mx.array:
    """Mean next-token cross-entropy over positions with a target (!= -100), in fp32 -- as
    edgetrain.training.losses.lm_loss (0 valid targets give nan, as torch does)."""
    logits = logits.reshape(-1, logits.shape[-1]).astype(mx.float32)
    targets = targets.reshape(-1)
    valid = targets != IGNORE_INDEX
    safe = mx.where(valid, targets, 0)
    target_logits = mx.take_along_axis(logits, safe[:, None], axis=1)[:, 0]
    token_loss = mx.logsumexp(logits, axis=1) - target_logits
    return mx.sum(mx.where(valid, token_loss, 0.0)) / mx.sum(valid)


def no_options(name: str, options: dict[str, Any]) -> None:
    if options:
        raise EdgetrainError(f"method {name!r} takes no options; got {', '.join(sorted(options))}")


def clear_memory() -> None:
    """Give MLX's cached buffers back to the system (the paper's GPU.clearCache())."""
    mx.clear_cache()


def require_lm(model: nn.Module, method: str) -> None:
    if getattr(model, "task", None) != "lm" or not hasattr(model, "blocks"):
        raise EdgetrainError(f"MLX method {method!r} trains MLX decoders (edgetrain.backends.mlx.model)")
