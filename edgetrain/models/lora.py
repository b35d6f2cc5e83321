"""LoRA adapters for decoder linears: y = x W^T + b + scale * (x A^T) B^T, base W frozen.

A is stored [rank, in] and B [out, rank] (the PEFT layout), scale = alpha / rank, A ~ kaiming-uniform,
B = 0 so that a fresh adapter leaves the model unchanged.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from edgetrain.registry import EdgetrainError

# Short target names -> the module attribute they adapt inside a decoder block.
LORA_TARGETS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                "down": "mlp.down_proj"}


@dataclass
class LoraConfig:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")

    def __post_init__(self) -> None:
        self.targets = tuple(self.targets)
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown:
            raise EdgetrainError(f"unknown LoRA target(s) {unknown}; known: {', '.join(LORA_TARGETS)}")
        if not self.targets:
            raise EdgetrainError("LoRA needs at least one target module")
        if not (isinstance(self.rank, int) and self.rank > 0):
            raise EdgetrainError(f"LoRA rank must be a positive integer, got {self.rank!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise EdgetrainError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.base = base
        self.rank = rank
        self.scale = alpha / rank
        self.dropout = dropout
        factory = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, **factory))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, **factory))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.merged = False
        base.weight.requires_grad_(False)
        if base.bias is not None:
            base.bias.requires_grad_(False)

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.merged:
            return y
        x_in = F.dropout(x, self.dropout, self.training) if self.dropout else x
        return y + (x_in @ self.lora_A.t() @ self.lora_B.t()) * self.scale

    def delta_weight(self) -> torch.Tensor:
        return (self.lora_B @ self.lora_A) * self.scale

    @torch.no_grad()
    def merge(self) -> None:
        if not self.merged:
            self.base.weight += self.delta_weight().to(self.base.weight.dtype)
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            self.base.weight -= self.delta_weight().to(self.base.weight.dtype)
            self.merged = False


def _resolve(block: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    parent_path, _, attr = dotted.rpartition(".")
    return block.get_submodule(parent_path), attr


def add_lora(model: nn.Module, config: LoraConfig | None = None, **overrides) -> nn.Module:
    """Freeze every weight of `model` and wrap the target linears of each block with LoRA (in place)."""
    config = config or LoraConfig(**overrides)
    if overrides and config is not None and not isinstance(config, LoraConfig):
        raise EdgetrainError("add_lora takes a LoraConfig or keyword overrides")
    if not hasattr(model, "blocks"):
        raise EdgetrainError(f"{type(model).__name__} has no block view (model.blocks); cannot add LoRA")
    if lora_layers(model):
        raise EdgetrainError("model already has LoRA adapters")
    for param in model.parameters():
        param.requires_grad_(False)
    for block in model.blocks:
        for target in config.targets:
            parent, attr = _resolve(block, LORA_TARGETS[target])
            base = getattr(parent, attr)
            if not isinstance(base, nn.Linear):
                raise EdgetrainError(f"LoRA target {target!r} is a {type(base).__name__}, not a Linear")
            setattr(parent, attr, LoRALinear(base, config.rank, config.alpha, config.dropout))
    model.lora_config = config
    return model


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters() if "lora_" in name.rsplit(".", 1)[-1]}


def merge_lora(model: nn.Module) -> None:
    for layer in lora_layers(model).values():
        layer.merge()


def unmerge_lora(model: nn.Module) -> None:
    for layer in lora_layers(model).values():
        layer.unmerge()


def save_lora(model: nn.Module, path: str | Path) -> Path:
    """Write only the adapter weights (safetensors, atomically) with the LoRA config in its metadata."""
    from edgetrain.checkpoint import atomic_save_safetensors

    config = getattr(model, "lora_config", None)
    if config is None:
        raise EdgetrainError("model has no LoRA adapters to save")
    tensors = {k: v.contiguous() for k, v in lora_state_dict(model).items()}
    return atomic_save_safetensors(tensors, path, metadata={"lora_config": json.dumps(asdict(config))})


def load_lora(model: nn.Module, path: str | Path) -> nn.Module:
    """Load adapter weights saved by save_lora; adds adapters with the saved config when absent."""
    from edgetrain.checkpoint import load_safetensors_checked

    tensors, metadata = load_safetensors_checked(path)
    if "lora_config" not in metadata:
        raise EdgetrainError(f"{path}: not a LoRA adapter file (no lora_config in its metadata)")
    config = LoraConfig(**json.loads(metadata["lora_config"]))
    if not lora_layers(model):
        add_lora(model, config)
    own = dict(model.named_parameters())
    for name, tensor in tensors.items():
        if name not in own:
            raise EdgetrainError(f"{path}: adapter tensor {name!r} has no place in this model")
        if own[name].shape != tensor.shape:
            raise EdgetrainError(f"{path}: adapter tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(own[name].shape)}")
        with torch.no_grad():
            own[name].copy_(tensor)
    return model
