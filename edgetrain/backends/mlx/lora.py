"""LoRA adapters for the MLX decoder, in mlx-lm's layout: y = linear(x) + scale * (x @ lora_a) @ lora_b
with lora_a [in, rank], lora_b [rank, out] -- the transposes of edgetrain's torch LoRA (A [rank, in],
B [out, rank]) -- and scale = alpha / rank. A fresh lora_b is zero, so a new adapter changes nothing.

The configuration is edgetrain's torch LoraConfig (same targets, rank, alpha, dropout).
"""
from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from edgetrain.backends.mlx.quantize import QuantizedLinear
from edgetrain.models.lora import LORA_TARGETS, LoraConfig
from edgetrain.registry import EdgetrainError


class LoRALinear(nn.Module):
    def __init__(self, linear: nn.Module, rank: int, scale: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.linear = linear
        self.scale = float(scale)
        self.dropout = float(dropout)
        out_features, in_features = linear_shape(linear)
        # Kaiming-uniform(a=sqrt(5)) bound, as torch's nn.Linear and edgetrain's torch LoRA use.
        bound = 1.0 / math.sqrt(in_features)
        dtype = linear.scales.dtype if isinstance(linear, QuantizedLinear) else linear.weight.dtype
        self.lora_a = mx.random.uniform(-bound, bound, (in_features, rank)).astype(dtype)
        self.lora_b = mx.zeros((rank, out_features), dtype=dtype)

    @property
    def rank(self) -> int:
        return self.lora_a.shape[1]

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        x_in = x
        if self.dropout and self.training:
            keep = mx.random.bernoulli(1.0 - self.dropout, x.shape)
            x_in = mx.where(keep, x / (1.0 - self.dropout), 0)
        return y + ((x_in @ self.lora_a) @ self.lora_b) * self.scale


def linear_shape(linear: nn.Module) -> tuple[int, int]:
    """(out_features, in_features) of an nn.Linear or a QuantizedLinear."""
    if isinstance(linear, QuantizedLinear):
        return linear.out_features, linear.in_features
    if isinstance(linear, nn.Linear):
        return tuple(linear.weight.shape)  # type: ignore[return-value]
    raise EdgetrainError(f"LoRA adapts linear layers, not a {type(linear).__name__}")


def resolve_path(block: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    parent_path, _, attr = dotted.rpartition(".")
    parent = block
    for part in parent_path.split("."):
        parent = getattr(parent, part)
    return parent, attr


def add_lora(model: nn.Module, config: LoraConfig | None = None, *, num_layers: int | None = None,
             **overrides) -> nn.Module:
    """Freeze every weight of `model` and wrap the target linears of its blocks with LoRA (in place):
    all blocks, or the last `num_layers` (mlx-lm's convention)."""
    if config is not None and overrides:
        raise EdgetrainError("add_lora takes a LoraConfig or keyword overrides, not both")
    config = config or LoraConfig(**overrides)
    if lora_layers(model):
        raise EdgetrainError("model already has LoRA adapters")
    total = len(model.blocks)
    num_layers = total if num_layers is None else num_layers
    if not 0 < num_layers <= total:
        raise EdgetrainError(f"LoRA on the last {num_layers} blocks: the model has {total}")
    model.freeze()
    for block in model.blocks[total - num_layers:]:
        for target in config.targets:
            parent, attr = resolve_path(block, LORA_TARGETS[target])
            setattr(parent, attr, LoRALinear(getattr(parent, attr), config.rank, config.scale, config.dropout))
    model.lora_config = config
    mx.eval(model.trainable_parameters())
    return model


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def trainable_parameters(model: nn.Module) -> dict[str, mx.array]:
    """Flat {dotted name: array} of the trainable parameters ("blocks.0.self_attn.q_proj.lora_a", ...)."""
    params = dict(tree_flatten(model.trainable_parameters()))
    if not params:
        raise EdgetrainError(f"{type(model).__name__} has no trainable parameters "
                             "(every weight is frozen; add LoRA adapters)")
    return params


def set_parameters(model: nn.Module, params: dict[str, mx.array]) -> None:
    """Write flat {dotted name: array} into the model (arrays are immutable: this rebinds them)."""
    from mlx.utils import tree_unflatten

    model.update(tree_unflatten(list(params.items())))
