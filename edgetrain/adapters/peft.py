"""LoRA adapters in Hugging Face PEFT's format: a directory with adapter_config.json and
adapter_model.safetensors, which `peft.PeftModel.from_pretrained(transformers_model, directory)` loads.

Only what edgetrain's LoRA is can be written or read: plain LoRA (no rsLoRA, DoRA, bias training,
per-layer rank or alpha patterns, layer subsets or extra trainable modules) on the projections of every
decoder block. Anything else in a PEFT config is refused by name rather than loaded approximately.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from edgetrain.models.lora import (LORA_TARGETS, AdapterError, LoraConfig, check_adapter_names, install_adapter,
                                   lora_state_dict)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# edgetrain target -> the module name PEFT's target_modules uses (the last part of the module path)
PEFT_MODULE = {target: path.rsplit(".", 1)[-1] for target, path in LORA_TARGETS.items()}
_EDGETRAIN_KEY = re.compile(r"^blocks\.(\d+)\.(.+)\.lora_([AB])$")
_PEFT_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")
# PEFT config keys whose value must be "off" for the adapter to be plain LoRA, and that value: written
# with every adapter, and checked (with the newer keys below) on every adapter read.
_MUST_BE_OFF = {"use_rslora": False, "use_dora": False, "bias": "none", "fan_in_fan_out": False,
                "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
                "rank_pattern": {}, "alpha_pattern": {}}
_ALSO_OFF_WHEN_READ = {"lora_bias": False, "target_parameters": None, "layer_replication": None,
                       "trainable_token_indices": None, "use_qalora": False}


def peft_key(name: str) -> str:
    """edgetrain's adapter tensor name -> PEFT's (the transformers model's parameter path)."""
    match = _EDGETRAIN_KEY.fullmatch(name)
    if match is None:
        raise AdapterError(f"{name!r} is not a decoder block's LoRA tensor")
    block, module, half = match.groups()
    return f"base_model.model.model.layers.{block}.{module}.lora_{half}.weight"


def edgetrain_key(name: str, source: str | Path) -> str:
    match = _PEFT_KEY.fullmatch(name)
    if match is None:
        raise AdapterError(f"{source}: tensor {name!r} is not a LoRA weight of a decoder layer "
                           "(base_model.model.model.layers.N.<module>.lora_A/B.weight)")
    block, module, half = match.groups()
    return f"blocks.{block}.{module}.lora_{half}"


def save_peft_adapter(model: nn.Module, directory: str | Path, base_model: str | None = None) -> Path:
    """Write the model's LoRA adapter as a PEFT adapter directory (atomically: the old directory or the
    whole new one). `base_model` is recorded as base_model_name_or_path (PEFT uses it only as a hint)."""
    config: LoraConfig | None = getattr(model, "lora_config", None)
    if config is None:
        raise AdapterError("the model has no LoRA adapter to save")
    return write_peft_adapter(config, lora_state_dict(model), directory, base_model)


def write_peft_adapter(config: LoraConfig, tensors: dict[str, torch.Tensor], directory: str | Path,
                       base_model: str | None = None) -> Path:
    """Adapter `tensors` (edgetrain names) with `config` as a PEFT adapter directory, written atomically."""
    from safetensors.torch import save_file

    from edgetrain.files.space import tensor_bytes
    from edgetrain.training.checkpoint import atomic_write_directory

    renamed = {peft_key(name): t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    peft_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
                   "r": config.rank, "lora_alpha": config.alpha, "lora_dropout": config.dropout,
                   "target_modules": sorted(PEFT_MODULE[t] for t in config.targets), "inference_mode": True,
                   **_MUST_BE_OFF}

    def fill(staging: Path) -> None:
        save_file(renamed, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        (staging / CONFIG_FILE).write_text(json.dumps(peft_config, indent=2))

    return atomic_write_directory(directory, fill, needed=tensor_bytes(renamed.values()))


def _config_from_peft(raw: Any, source: Path) -> LoraConfig:
    if not isinstance(raw, dict):
        raise AdapterError(f"{source}: {CONFIG_FILE} is not a JSON object")
    if raw.get("peft_type") != "LORA":
        raise AdapterError(f"{source}: peft_type {raw.get('peft_type')!r}; only LORA adapters load")
    for key, off in {**_MUST_BE_OFF, **_ALSO_OFF_WHEN_READ}.items():
        value = raw.get(key, off)
        if value != off and not (off in ({}, None) and not value):
            raise AdapterError(f"{source}: {key} = {value!r} is not supported (edgetrain's LoRA is plain "
                               f"LoRA; {key} must be {off!r})")
    modules = raw.get("target_modules")
    if isinstance(modules, str) or not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise AdapterError(f"{source}: target_modules must be a list of module names, got {modules!r}")
    by_module = {module: target for target, module in PEFT_MODULE.items()}
    unknown = [m for m in modules if m not in by_module]
    if unknown:
        raise AdapterError(f"{source}: target module(s) {unknown} are not decoder projections edgetrain adapts "
                           f"({', '.join(sorted(by_module))})")
    order = list(PEFT_MODULE.values())
    try:
        return LoraConfig(rank=raw.get("r"), alpha=raw.get("lora_alpha"), dropout=raw.get("lora_dropout", 0.0),
                          targets=tuple(by_module[m] for m in sorted(modules, key=order.index)))
    except AdapterError as exc:
        raise AdapterError(f"{source}: {exc}") from None


def read_peft_adapter(directory: str | Path) -> tuple[LoraConfig, dict[str, torch.Tensor], Path]:
    """(config, tensors under edgetrain's names, the weights file) of a PEFT LoRA adapter directory, whose
    config must describe plain LoRA on decoder projections."""
    from edgetrain.files.user import read_json_object
    from edgetrain.training.checkpoint import readable_directory

    directory = readable_directory(directory)
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise AdapterError(f"{directory}: not a PEFT adapter directory (no {path.name})")
    config = _config_from_peft(read_json_object(config_path, AdapterError, "the PEFT adapter config"), config_path)
    try:
        from safetensors.torch import load_file

        raw = load_file(str(weights_path))
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise AdapterError(f"{weights_path}: cannot read the adapter weights ({exc})") from None
    tensors = {}
    for name, tensor in raw.items():
        key = edgetrain_key(name, weights_path)
        try:
            check_adapter_names({key: tensor}, config, weights_path)
        except AdapterError as exc:  # named as the file names it
            raise AdapterError(f"{weights_path}: cannot place tensor {name!r} "
                               f"({str(exc).split(': ', 1)[-1]})") from None
        tensors[key] = tensor
    return config, tensors, weights_path


def load_peft_adapter(model: nn.Module, directory: str | Path) -> nn.Module:
    """Read a PEFT LoRA adapter directory into `model` (adapters added when it has none). Its config must
    describe plain LoRA on decoder projections; its tensors must be exactly the adapter's, finite and of
    the model's shapes. All or nothing: on any error the model is as it was."""
    config, tensors, weights_path = read_peft_adapter(directory)
    return install_adapter(model, config, tensors, weights_path)


def is_peft_adapter(path: str | Path) -> bool:
    """A directory whose adapter_config.json says peft_type (mlx-lm's says fine_tune_type instead)."""
    config = Path(path) / CONFIG_FILE
    if not (Path(path).is_dir() and config.is_file()):
        return False
    try:
        return "peft_type" in json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return True  # a damaged PEFT config: let read_peft_adapter say what is wrong with it
