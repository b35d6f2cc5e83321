"""Load Hugging Face-format checkpoint directories (config.json + *.safetensors, sharded or not).

Only safetensors are read: no pickle, so a checkpoint from an untrusted source cannot run code.
"""
from __future__ import annotations

from pathlib import Path
from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from edgetrain.models.llama import ConfigError
from edgetrain.models.zoo import ARCHITECTURES
from edgetrain.registry import EdgetrainError, UnknownNameError
from edgetrain.files.user import read_json_object, require_regular_file
from edgetrain.models.meta_build import meta_without_init


class CheckpointError(EdgetrainError, OSError):
    """A checkpoint directory or file that is missing, damaged or does not fit the model."""


def read_config(directory: Path) -> dict[str, Any]:
    config_path = directory / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{directory}: no config.json (expected a Hugging Face-format checkpoint directory)")
    return read_json_object(config_path, ConfigError, "the model config")


def _shard_names(index_path: Path) -> list[str]:
    index = read_json_object(index_path, CheckpointError, "the shard index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path}: damaged shard index (weight_map must be a non-empty object "
                              "of tensor name -> shard file)")
    bad = [(key, name) for key, name in weight_map.items() if not isinstance(name, str) or not name]
    if bad:
        key, name = bad[0]
        raise CheckpointError(f"{index_path}: damaged shard index: weight_map[{key!r}] = {name!r} is not a file name")
    names = sorted(set(weight_map.values()))
    for name in names:
        if Path(name).name != name or name in (".", ".."):  # a shard must not escape the checkpoint directory
            raise CheckpointError(f"{index_path}: shard name {name!r} is not a plain file name")
    return names


def safetensors_files(directory: Path) -> list[Path]:
    index_path = directory / "model.safetensors.index.json"
    if index_path.exists():
        files = [directory / name for name in _shard_names(index_path)]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index_path} names shard(s) that do not exist: {', '.join(missing)}")
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        if any(directory.glob("*.bin")) or any(directory.glob("*.pt")):
            raise CheckpointError(f"{directory}: only pickle weights (*.bin/*.pt) found; edgetrain loads "
                                  "safetensors only (convert with transformers' save_pretrained(safe_serialization=True))")
        raise CheckpointError(f"{directory}: no *.safetensors weight files")
    return [require_regular_file(f, CheckpointError, "a weight shard") for f in files]


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    require_regular_file(path, CheckpointError, "a weight shard")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError, OverflowError) as exc:
        raise CheckpointError(f"{path}: damaged or unreadable safetensors file ({exc})") from None


def load_weights(model: nn.Module, tensors: dict[str, torch.Tensor], source: str,
                 dtype: torch.dtype, key_map: Any = None, as_stored: Collection[str] = ()) -> None:
    """Assign checkpoint tensors to `model` (which may live on the meta device), strictly:
    every parameter must be present with the right shape; unknown tensors are an error. Floating-point
    tensors are cast to `dtype`, except those named in `as_stored` (packed scales, kept exact)."""
    expected = model.state_dict(keep_vars=True)
    tied_aliases = _tied_aliases(model)
    state: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        name = key_map(key) if key_map else key
        if name is None or name in tied_aliases:
            continue
        if name not in expected:
            raise CheckpointError(f"{source}: tensor {key!r} does not belong to a {type(model).__name__}")
        want = tuple(expected[name].shape)
        if tuple(tensor.shape) != want:
            raise CheckpointError(f"{source}: tensor {key!r} has shape {tuple(tensor.shape)}, "
                                  f"the model expects {want}")
        if expected[name].is_floating_point() and not tensor.is_floating_point():
            raise CheckpointError(f"{source}: tensor {key!r} holds {tensor.dtype} values; the model's weights "
                                  "are floating point")
        state[name] = tensor.to(dtype) if tensor.is_floating_point() and key not in as_stored else tensor
    missing = [k for k in expected if k not in state and k not in tied_aliases]
    if missing:
        raise CheckpointError(f"{source}: missing tensor(s) {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    model.load_state_dict(state, strict=False, assign=True)
    _retie(model)


def _tied_aliases(model: nn.Module) -> set[str]:
    config = getattr(model, "config", None)
    return {"head.lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()


def _retie(model: nn.Module) -> None:
    # assign=True replaced the embedding Parameter; the tied head must point at the new one.
    if _tied_aliases(model) and isinstance(model.embed.embed_tokens, nn.Embedding):  # a packed one ties itself
        model.head.lm_head.weight = model.embed.embed_tokens.weight


def norm_offset(config: Any) -> float:
    """What the architecture's checkpoints store of its norm weights less the factor they multiply by (Gemma's
    1 + w: 1.0), 0.0 for the others."""
    from edgetrain.models.decoders import architecture_of
    from edgetrain.models.llama import LlamaConfig

    return architecture_of(config).norm_offset if isinstance(config, LlamaConfig) else 0.0


def with_norm_offset(tensors: dict[str, Any], offset: float) -> dict[str, Any]:
    """Every norm weight ("...norm.weight") plus `offset`, computed in float32 (as Gemma computes 1 + w) and
    kept in float32: the loader rounds it to the model's dtype."""
    if not offset:
        return tensors
    return {key: (tensor.float() + offset) if key.endswith("norm.weight") else tensor
            for key, tensor in tensors.items()}


def load_checkpoint_dir(directory: str | Path, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> nn.Module:
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    raw = read_config(directory)
    model_type = raw.get("model_type")
    try:
        build = ARCHITECTURES.get(str(model_type))
    except UnknownNameError:
        from edgetrain.models.decoders import decoder_architecture

        decoder_architecture(model_type, str(directory / "config.json"))  # says what it lacks, or lists what is built
        raise
    # Build on the meta device so the random init never costs memory or time; weights are then assigned.
    with meta_without_init():
        model = build(raw)
    from edgetrain.models.llama import hf_key_to_edgetrain

    tensors: dict[str, torch.Tensor] = {}
    for path in safetensors_files(directory):
        for key, tensor in read_safetensors(path).items():
            if key in tensors:
                raise CheckpointError(f"{path}: tensor {key!r} appears in more than one shard")
            tensors[key] = tensor
    load_weights(model, with_norm_offset(tensors, norm_offset(model.config)), str(directory), dtype,
                 key_map=hf_key_to_edgetrain)
    from edgetrain.data.tokenizer import attach_tokenizer

    attach_tokenizer(model, directory, model.config.vocab_size)  # its tokenizer.json, when it has one
    return model.to(device)
