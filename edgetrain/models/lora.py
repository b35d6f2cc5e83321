"""LoRA adapters for decoder linears: y = x W^T + b + scale * (x A^T) B^T, base W frozen.

A is stored [rank, in] and B [out, rank] (the PEFT layout), scale = alpha / rank, A ~ kaiming-uniform,
B = 0 so that a fresh adapter leaves the model unchanged.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from edgetrain.models.quantized import QuantizedLinear
from edgetrain.registry import EdgetrainError

def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# Short target names -> the module attribute they adapt inside a decoder block.
LORA_TARGETS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                "down": "mlp.down_proj"}


class AdapterError(EdgetrainError, ValueError):
    """An adapter directory or file that is missing, damaged or does not fit the model."""


# Far beyond any adapter of a decoder a device could train; a larger rank is a damaged config.
_MAX_RANK = 1 << 16


@dataclass
class LoraConfig:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")

    def __post_init__(self) -> None:
        if isinstance(self.targets, str) or not isinstance(self.targets, (list, tuple)):
            raise AdapterError(f"LoRA targets must be a list of names ({', '.join(LORA_TARGETS)}), "
                               f"got {self.targets!r}")
        self.targets = tuple(self.targets)
        unknown = [t for t in self.targets if not isinstance(t, str) or t not in LORA_TARGETS]
        if unknown:
            raise AdapterError(f"unknown LoRA target(s) {unknown}; known: {', '.join(LORA_TARGETS)}")
        if not self.targets:
            raise AdapterError("LoRA needs at least one target module")
        if len(set(self.targets)) != len(self.targets):
            raise AdapterError(f"LoRA targets {list(self.targets)} name a module twice")
        if not (isinstance(self.rank, int) and not isinstance(self.rank, bool) and 0 < self.rank <= _MAX_RANK):
            raise AdapterError(f"LoRA rank must be an integer in 1..{_MAX_RANK}, got {self.rank!r}")
        # alpha sets the scale alpha / rank of every update: NaN, inf or a string would reach the weights.
        if not (_is_real(self.alpha) and 0 < self.alpha < math.inf):
            raise AdapterError(f"LoRA alpha must be a finite number > 0, got {self.alpha!r}")
        if not (_is_real(self.dropout) and 0.0 <= self.dropout < 1.0):
            raise AdapterError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")

    @classmethod
    def from_json(cls, text: str, source: str) -> "LoraConfig":
        """The config stored with an adapter (`source` names the file in errors)."""
        from edgetrain.files.user import parse_json

        raw = parse_json(text, AdapterError, f"{source} (LoRA config)")
        known = {f.name for f in fields(cls)}
        if not isinstance(raw, dict) or not set(raw) <= known:
            extra = sorted(set(raw) - known) if isinstance(raw, dict) else type(raw).__name__
            raise AdapterError(f"{source}: damaged LoRA config (expected an object of {', '.join(sorted(known))}; "
                               f"got {extra})")
        try:
            return cls(**raw)
        except AdapterError as exc:
            raise AdapterError(f"{source}: {exc}") from None

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
        # A quantised base (edgetrain.models.quantized) is all buffers, stored packed; it names its dtype.
        if isinstance(base, QuantizedLinear):
            factory = dict(device=base.device, dtype=base.dtype)
        else:
            factory = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, **factory))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, **factory))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.merged = False
        if not isinstance(base, QuantizedLinear):
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
        if isinstance(self.base, QuantizedLinear):
            raise EdgetrainError("cannot merge a LoRA adapter into a quantised base weight (it would have to be "
                                 "requantised): merge into the dense model (edgetrain export --merge) instead")
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
    requires_grad = {name: p.requires_grad for name, p in model.named_parameters()}
    for param in model.parameters():
        param.requires_grad_(False)
    try:
        for block in model.blocks:
            for target in config.targets:
                parent, attr = _resolve(block, LORA_TARGETS[target])
                base = getattr(parent, attr)
                if not isinstance(base, (nn.Linear, QuantizedLinear)):
                    raise EdgetrainError(f"LoRA target {target!r} is a {type(base).__name__}, not a Linear")
                setattr(parent, attr, LoRALinear(base, config.rank, config.alpha, config.dropout))
    except BaseException:  # a model half wrapped is worse than none: give every base linear back
        remove_lora(model, requires_grad)
        raise
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
    config = getattr(model, "lora_config", None)
    if config is None:
        raise EdgetrainError("model has no LoRA adapters to save")
    return write_lora_file(config, lora_state_dict(model), path)


def write_lora_file(config: LoraConfig, tensors: dict[str, torch.Tensor], path: str | Path) -> Path:
    """edgetrain's adapter file: the tensors (edgetrain names) in safetensors, the config in its metadata,
    written atomically."""
    from edgetrain.training.checkpoint import atomic_save_safetensors

    return atomic_save_safetensors({k: v.contiguous() for k, v in tensors.items()}, path,
                                   metadata={"lora_config": json.dumps(asdict(config))})


def read_lora_file(path: str | Path) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """(config, tensors) of an edgetrain adapter file, checksum verified, every tensor name one edgetrain can
    place (check_adapter_names)."""
    from edgetrain.training.checkpoint import load_safetensors_checked

    tensors, metadata = load_safetensors_checked(path)
    if "lora_config" not in metadata:
        raise AdapterError(f"{path}: not a LoRA adapter file (no lora_config in its metadata)")
    config = LoraConfig.from_json(metadata["lora_config"], str(path))
    check_adapter_names(tensors, config, path)
    return config, tensors


# edgetrain's adapter tensor names: add_lora wraps LORA_TARGETS of each of model.blocks, so every adapter
# tensor is blocks.<i>.<target path>.lora_A|B. ASCII digits only, no leading zero (Python's \d takes other
# scripts' digits and int() reads "007" as block 7), and at most 9 of them.
_ADAPTER_NAME = re.compile(r"blocks\.(0|[1-9][0-9]{0,8})\.([a-z_]+\.[a-z_]+)\.lora_([AB])", re.ASCII)
_TARGET_OF_PATH = {path: target for target, path in LORA_TARGETS.items()}


def adapter_tensor_place(name: object, source: str | Path) -> tuple[int, str, str]:
    """(block index, module path, "A" or "B") of an adapter tensor named as edgetrain names them, or an
    AdapterError that names the tensor (a converter or loader must never fail on a name by unpacking it)."""
    match = _ADAPTER_NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None or match.group(2) not in _TARGET_OF_PATH:
        shown = repr(name) if not isinstance(name, str) or len(name) <= 120 else \
            f"{name[:120]!r}... ({len(name)} characters)"
        raise AdapterError(f"{source}: cannot place adapter tensor {shown}: edgetrain's adapter tensors are named "
                           f"blocks.<i>.<module>.lora_A or .lora_B, <module> one of {', '.join(LORA_TARGETS.values())}")
    return int(match.group(1)), match.group(2), match.group(3)


def check_adapter_names(tensors: dict[str, Any], config: LoraConfig, source: str | Path) -> None:
    """Every tensor name placeable (adapter_tensor_place) and of a module `config` adapts; the first that is
    not is named."""
    adapted = {LORA_TARGETS[target] for target in config.targets}
    for name in tensors:
        _, path, _ = adapter_tensor_place(name, source)
        if path not in adapted:
            raise AdapterError(f"{source}: cannot place adapter tensor {name!r}: its LoRA config adapts "
                               f"{', '.join(config.targets)}, not {_TARGET_OF_PATH[path]} ({path})")


def remove_lora(model: nn.Module, requires_grad: dict[str, bool] | None = None) -> None:
    """Undo add_lora: every LoRALinear gives its base linear back (in place); `requires_grad` (name ->
    flag, as before add_lora) restores which base weights were trainable."""
    for name, layer in list(lora_layers(model).items()):
        parent_path, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_path), attr, layer.base)
    for name, param in model.named_parameters():
        if requires_grad is not None and name in requires_grad:
            param.requires_grad_(requires_grad[name])
    if hasattr(model, "lora_config"):
        del model.lora_config


def check_adapter_tensors(tensors: dict[str, torch.Tensor], own: dict[str, torch.Tensor], path: str | Path) -> None:
    """Every adapter tensor of the model present, nothing else (a base weight's name would overwrite it),
    each with its shape, floating point and finite."""
    for name, tensor in tensors.items():
        if name not in own:
            raise AdapterError(f"{path}: adapter tensor {name!r} has no place among this model's LoRA weights")
        if own[name].shape != tensor.shape:
            raise AdapterError(f"{path}: adapter tensor {name!r} has shape {tuple(tensor.shape)}, "
                               f"the model expects {tuple(own[name].shape)}")
        if not tensor.is_floating_point():
            raise AdapterError(f"{path}: adapter tensor {name!r} holds {tensor.dtype} values, not floating point")
        if not bool(torch.isfinite(tensor).all()):
            raise AdapterError(f"{path}: adapter tensor {name!r} holds NaN or infinite values")
    missing = sorted(set(own) - set(tensors))
    if missing:
        raise AdapterError(f"{path}: missing adapter tensor(s) {', '.join(missing[:5])}"
                           + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def load_lora(model: nn.Module, path: str | Path) -> nn.Module:
    """Load adapter weights saved by save_lora; adds adapters with the saved config when absent.

    Strict, and all or nothing: the file's config must equal the adapters the model already has (a
    different alpha would silently rescale every update), it must hold exactly the model's adapter
    tensors, and on any error the model is left as it was (adapters added here are removed again)."""
    config, tensors = read_lora_file(path)
    return install_adapter(model, config, tensors, path)


def install_adapter(model: nn.Module, config: LoraConfig, tensors: dict[str, torch.Tensor],
                    source: str | Path) -> nn.Module:
    """Put adapter `tensors` (edgetrain names) with `config` into `model`, whatever file format they came
    from: adapters are added when the model has none, else must have the same config; the tensors must be
    exactly the model's adapter tensors, finite, of the right shapes. All or nothing."""
    existing = getattr(model, "lora_config", None) if lora_layers(model) else None
    if existing is not None:
        differ = [f"{field} {getattr(config, field)!r} (the model's: {getattr(existing, field)!r})"
                  for field in ("rank", "alpha", "targets") if getattr(config, field) != getattr(existing, field)]
        if differ:
            raise AdapterError(f"{source}: the adapter's LoRA config differs from the model's adapters: "
                               + "; ".join(differ))
    requires_grad = {name: p.requires_grad for name, p in model.named_parameters()}
    if existing is None:
        add_lora(model, config)
    try:
        check_adapter_tensors(tensors, lora_state_dict(model), source)
    except AdapterError:
        if existing is None:
            remove_lora(model, requires_grad)
        raise
    own = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in tensors.items():
            own[name].copy_(tensor)
    return model
