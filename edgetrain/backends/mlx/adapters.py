"""LoRA adapters in mlx-lm's format, and conversion from/to edgetrain's torch adapter file.

mlx-lm's adapter directory (what `mlx_lm.lora` writes and `mlx_lm.load(..., adapter_path=)` reads):
  adapters.safetensors   model.layers.<i>.<module path>.lora_a [in, rank]
                         model.layers.<i>.<module path>.lora_b [rank, out]
  adapter_config.json    {"fine_tune_type": "lora", "num_layers": N (LoRA on the last N blocks;
                          0 or -1: all), "lora_parameters": {"rank", "scale", "dropout",
                          "keys": [module paths]}} -- mlx_lm.lora writes no "keys" by default,
                          meaning every linear of the adapted blocks; the tensor names say which.
mlx-lm's y = linear(x) + scale (x lora_a) lora_b equals edgetrain's torch
y = base(x) + (alpha / rank) (x A^T) B^T with lora_a = A^T, lora_b = B^T, scale = alpha / rank.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from edgetrain.backends.mlx.loading import to_numpy
from edgetrain.backends.mlx.lora import (add_lora, linear_shape, lora_layers, resolve_path, set_parameters,
                                         trainable_parameters)
from edgetrain.training.checkpoint import atomic_save_safetensors, atomic_write_directory, readable_directory
from edgetrain.models.lora import (LORA_TARGETS, AdapterError, LoraConfig, adapter_tensor_place, read_lora_file,
                                   write_lora_file)
from edgetrain.files.user import read_json_object, require_regular_file

ADAPTER_WEIGHTS = "adapters.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_TARGET_OF_PATH = {path: target for target, path in LORA_TARGETS.items()}


def mlx_lm_key(block: int, path: str, part: str) -> str:
    """mlx-lm's name of an adapter tensor: model.layers.<block>.<path>.<lora_a|lora_b>."""
    return f"model.layers.{block}.{path}.{part}"


def _parse_key(key: str, source: str) -> tuple[int, str, str]:
    prefix = "model.layers."
    head, _, part = key.rpartition(".")
    if not key.startswith(prefix) or part not in ("lora_a", "lora_b"):
        raise AdapterError(f"{source}: {key!r} is not an mlx-lm LoRA tensor name (model.layers.<i>.<module>.lora_a|b)")
    index, _, path = head[len(prefix):].partition(".")
    # ASCII digits, no leading zero, a sane count ("²".isdigit() holds and int() refuses it).
    if not (index.isascii() and index.isdigit() and len(index) <= 9 and (index == "0" or index[0] != "0")) \
            or path not in _TARGET_OF_PATH:
        raise AdapterError(f"{source}: {key!r} adapts no decoder projection edgetrain knows "
                           f"({', '.join(_TARGET_OF_PATH)})")
    return int(index), path, part


def _to_torch(array: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(array))


def _adapted_blocks(model: nn.Module) -> list[int]:
    return sorted({int(name.split(".")[1]) for name in lora_layers(model)})


def save_mlx_lm_adapters(model: nn.Module, directory: str | Path, extra_config: dict[str, Any] | None = None) -> Path:
    """Write `model`'s adapters as an mlx-lm adapter directory (both files as one atomic step)."""
    config: LoraConfig | None = getattr(model, "lora_config", None)
    if config is None or not lora_layers(model):
        raise AdapterError("model has no LoRA adapters to save")
    blocks = _adapted_blocks(model)
    total = len(model.blocks)
    if blocks != list(range(total - len(blocks), total)):
        raise AdapterError(f"mlx-lm adapters cover the last N blocks; these cover blocks {blocks}")
    tensors = {}
    for name, value in trainable_parameters(model).items():
        _, index, rest = name.split(".", 2)
        path, _, part = rest.rpartition(".")
        tensors[mlx_lm_key(int(index), path, part)] = _to_torch(to_numpy(value))
    adapter_config = {**(extra_config or {}), "fine_tune_type": "lora", "num_layers": len(blocks),
                      "lora_parameters": {"rank": config.rank, "scale": config.scale, "dropout": config.dropout,
                                          "keys": [LORA_TARGETS[t] for t in config.targets]}}
    return _write_adapter_directory(directory, tensors, adapter_config)


def _write_adapter_directory(directory: str | Path, tensors: dict[str, Any], adapter_config: dict[str, Any]) -> Path:
    """Both files as one atomic step (atomic_write_directory): a reader never sees new weights with an
    old config or the other way round."""
    def fill(new: Path) -> None:
        atomic_save_safetensors(tensors, new / ADAPTER_WEIGHTS, metadata={"format": "mlx"})
        (new / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2), encoding="utf-8")

    return atomic_write_directory(directory, fill)


def read_mlx_lm_adapters(directory: str | Path) -> tuple[LoraConfig, int, dict[str, np.ndarray]]:
    """(LoraConfig, num_layers, {mlx-lm key: float32 array}) of an mlx-lm adapter directory."""
    directory = readable_directory(directory)
    config_path, weights_path = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
    if not config_path.exists() or not weights_path.exists():
        raise AdapterError(f"{directory}: an mlx-lm adapter directory holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    raw = read_json_object(config_path, AdapterError, "the mlx-lm adapter config")
    fine_tune_type = raw.get("fine_tune_type", "lora")
    if fine_tune_type != "lora":
        raise AdapterError(f"{config_path}: fine_tune_type {fine_tune_type!r}; edgetrain reads LoRA adapters only")
    params = raw.get("lora_parameters")
    if not isinstance(params, dict):
        raise AdapterError(f"{config_path}: not an mlx-lm adapter config (lora_parameters must be an object)")
    num_layers = raw.get("num_layers")
    rank, scale, dropout, keys = params.get("rank"), params.get("scale"), params.get("dropout", 0.0), params.get("keys")
    for name, value in (("num_layers", num_layers), ("lora_parameters.rank", rank)):
        # int(2.7) would quietly adapt two blocks: an integer field must be a JSON integer.
        if not isinstance(value, int) or isinstance(value, bool):
            raise AdapterError(f"{config_path}: {name} must be an integer, got {value!r}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise AdapterError(f"{config_path}: lora_parameters.scale must be a number, got {scale!r}")
    if keys is not None and (not isinstance(keys, list) or not all(isinstance(k, str) for k in keys)):
        raise AdapterError(f"{config_path}: lora_parameters.keys must be a list of module paths, got {keys!r}")
    require_regular_file(weights_path, AdapterError, "the mlx-lm adapter weights")
    try:
        weights = {k: to_numpy(v).astype(np.float32) for k, v in mx.load(str(weights_path), format="safetensors").items()}
    except (RuntimeError, ValueError, OSError) as exc:
        raise AdapterError(f"{weights_path}: damaged or unreadable safetensors file ({exc})") from None
    broken = [k for k, array in weights.items() if not np.isfinite(array).all()]
    if broken:
        raise AdapterError(f"{weights_path}: adapter tensor {broken[0]!r} holds NaN or infinite values")
    paths = {_parse_key(key, str(weights_path))[1] for key in weights}
    if keys is None:
        # mlx-lm adapts every linear of a block when "keys" is absent: the tensors name them.
        keys = [path for path in LORA_TARGETS.values() if path in paths]
    unknown = [k for k in keys if k not in _TARGET_OF_PATH]
    if unknown or not keys:
        raise AdapterError(f"{config_path}: LoRA keys {unknown or keys} are not decoder projections edgetrain adapts")
    try:
        config = LoraConfig(rank=rank, alpha=scale * rank, dropout=dropout,
                            targets=tuple(_TARGET_OF_PATH[k] for k in keys))
    except AdapterError as exc:
        raise AdapterError(f"{config_path}: {exc}") from None
    return config, num_layers, weights


def _adapter_shapes(model: nn.Module, config: LoraConfig, num_layers: int) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the adapter tensors add_lora(model, config, num_layers=...) would create, read off
    the model without changing it."""
    total = len(model.blocks)
    count = num_layers if num_layers > 0 else total  # mlx-lm: 0 and -1 mean every block
    if count > total:
        raise AdapterError(f"the adapter is for the last {count} blocks; the model has {total}")
    shapes = {}
    for index in range(total - count, total):
        for target in config.targets:
            parent, attr = resolve_path(model.blocks[index], LORA_TARGETS[target])
            out_features, in_features = linear_shape(getattr(parent, attr))
            name = f"blocks.{index}.{LORA_TARGETS[target]}"
            shapes[f"{name}.lora_a"], shapes[f"{name}.lora_b"] = (in_features, config.rank), (config.rank, out_features)
    return shapes


def load_mlx_lm_adapters(model: nn.Module, directory: str | Path) -> nn.Module:
    """Load an mlx-lm adapter directory into `model` (adding the adapters when it has none), strictly and
    all or nothing: the config equal to the model's adapters when it has some, every adapter tensor
    present with its shape, none without a place; everything is checked before the model is touched."""
    config, num_layers, weights = read_mlx_lm_adapters(directory)
    existing = getattr(model, "lora_config", None) if lora_layers(model) else None
    if existing is not None:
        differ = [f"{field} {getattr(config, field)!r} (the model's: {getattr(existing, field)!r})"
                  for field in ("rank", "alpha", "targets") if getattr(config, field) != getattr(existing, field)]
        if differ:
            raise AdapterError(f"{directory}: the adapter's LoRA config differs from the model's adapters: "
                               + "; ".join(differ))
        shapes = {name: tuple(array.shape) for name, array in trainable_parameters(model).items()}
    else:
        try:
            shapes = _adapter_shapes(model, config, num_layers)
        except AdapterError as exc:
            raise AdapterError(f"{directory}: {exc}") from None
    renamed = {}
    for key, array in weights.items():
        index, path, part = _parse_key(key, str(directory))
        name = f"blocks.{index}.{path}.{part}"
        if name not in shapes:
            raise AdapterError(f"{directory}: adapter tensor {key!r} has no place in this model")
        if tuple(array.shape) != shapes[name]:
            raise AdapterError(f"{directory}: adapter tensor {key!r} has shape {tuple(array.shape)}, "
                               f"the model expects {shapes[name]}")
        renamed[name] = array
    missing = sorted(set(shapes) - set(renamed))
    if missing:
        raise AdapterError(f"{directory}: missing adapter tensor(s) {', '.join(missing[:5])}")
    if existing is None:
        add_lora(model, config, num_layers=num_layers if num_layers > 0 else None)
    own = trainable_parameters(model)
    set_parameters(model, {name: mx.array(array).astype(own[name].dtype) for name, array in renamed.items()})
    mx.eval(model.trainable_parameters())
    return model


def torch_adapter_to_mlx_lm(torch_file: str | Path, directory: str | Path) -> Path:
    """Convert an adapter file written by edgetrain.save_lora (torch) into an mlx-lm adapter directory."""
    config, tensors = read_lora_file(torch_file)
    converted, blocks = {}, set()
    for name, tensor in tensors.items():
        index, path, half = adapter_tensor_place(name, torch_file)  # a name it cannot place is named
        blocks.add(index)
        # A [r, in] -> lora_a [in, r]; B [out, r] -> lora_b [r, out].
        converted[mlx_lm_key(index, path, f"lora_{half.lower()}")] = tensor.float().t().contiguous()
    adapter_config = {"fine_tune_type": "lora", "num_layers": len(blocks),
                      "lora_parameters": {"rank": config.rank, "scale": config.scale, "dropout": config.dropout,
                                          "keys": [LORA_TARGETS[t] for t in config.targets]}}
    return _write_adapter_directory(directory, converted, adapter_config)


def mlx_lm_to_torch_adapter(directory: str | Path, torch_file: str | Path) -> Path:
    """Convert an mlx-lm adapter directory into an adapter file edgetrain.load_lora (torch) reads.
    Block indices are kept as they are (mlx-lm numbers blocks from the model's first)."""
    config, _, weights = read_mlx_lm_adapters(directory)
    tensors = {}
    for key, array in weights.items():
        index, path, part = _parse_key(key, str(directory))
        tensors[f"blocks.{index}.{path}.lora_{part[-1].upper()}"] = _to_torch(array.T.copy())
    return write_lora_file(config, tensors, torch_file)


def set_adapter_weights_from_torch(model: nn.Module, torch_lora: dict[str, Any]) -> None:
    """Copy edgetrain torch LoRA tensors ({"blocks.0.self_attn.q_proj.lora_A": [r, in], ...}) into
    `model`'s MLX adapters (transposed), e.g. to start both backends from the same adapter."""
    own = trainable_parameters(model)
    values = {}
    for name, tensor in torch_lora.items():
        head, _, part = name.rpartition(".")
        target = f"{head}.{part.lower()}"
        if target not in own:
            raise AdapterError(f"torch adapter tensor {name!r} has no place in this MLX model")
        values[target] = mx.array(tensor.detach().float().cpu().numpy().T.copy()).astype(own[target].dtype)
    set_parameters(model, values)
    mx.eval(model.trainable_parameters())
