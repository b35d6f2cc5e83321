"""MLX decoders by preset name (random init), from Hugging Face checkpoint directories or GGUF files
(edgetrain.backends.mlx.gguf), or copied from an edgetrain torch model.

Checkpoint directories go through the same checks as the torch loader (edgetrain.models.hf_checkpoint):
config.json validated by edgetrain.models.decoders.config_from_hf_dict, safetensors only, every tensor present with the
right shape, unknown tensors refused -- with the same error types.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from edgetrain.backends.mlx.model import MLXDecoder, hf_key_to_edgetrain
from edgetrain.backends.mlx.quantize import DEFAULT_GROUP_SIZE, ComputeMode, quantize_block, quantize_model
from edgetrain.backends.mlx.weights import assign_weights, parse_mlx_dtype
from edgetrain.models.hf_checkpoint import CheckpointError, norm_offset, read_config, safetensors_files
from edgetrain.files.user import require_regular_file
from edgetrain.models.decoders import config_from_hf_dict
from edgetrain.models.llama import LlamaConfig
from edgetrain.registry import EdgetrainError

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def preset_config(name: str) -> LlamaConfig:
    """The config of a decoder preset (the torch presets' shapes: edgetrain.models.decoder_presets)."""
    from edgetrain.models.decoder_presets import DECODER_PRESETS
    from edgetrain.models.decoder_presets import preset_config as decoder_preset

    config = decoder_preset(name)
    if config is None:
        raise EdgetrainError(f"unknown MLX model {name!r}: not a directory and not a decoder preset; "
                             f"known presets: {', '.join(DECODER_PRESETS)}")
    return config


def _init_block(block: nn.Module, std: float, dtype: mx.Dtype) -> None:
    """normal(0, std) weights, zero biases, unit norms (the torch presets' init, other random numbers)."""
    values = []
    for name, value in tree_flatten(block.parameters()):
        if name.endswith("layernorm.weight"):
            values.append((name, mx.ones(value.shape, dtype=dtype)))
        elif name.endswith(".bias"):
            values.append((name, mx.zeros(value.shape, dtype=dtype)))
        else:
            values.append((name, (mx.random.normal(value.shape) * std).astype(dtype)))
    block.update(tree_unflatten(values))


def build_random(config: LlamaConfig, *, dtype: str | mx.Dtype = "float32", seed: int = 0, std: float = 0.02,
                 layers: int | None = None, quantize_bits: int | None = None,
                 group_size: int = DEFAULT_GROUP_SIZE, compute_mode: ComputeMode | None = None) -> MLXDecoder:
    """A randomly initialised decoder. Blocks are initialised (and quantised) one at a time, so a
    3B-shape 4-bit model never holds its dense weights at once; `layers` keeps only the first N."""
    dtype = parse_mlx_dtype(dtype)
    if layers is not None:
        if not 0 < layers <= config.num_hidden_layers:
            raise EdgetrainError(f"layers={layers}: the model has {config.num_hidden_layers} blocks")
        config = replace(config, num_hidden_layers=layers)
    mx.random.seed(seed)
    # MLX arrays are lazy: the constructor's own random weights are replaced before anything
    # evaluates them, so they never take memory.
    model = MLXDecoder(config)
    model.embed.embed_tokens.weight = (mx.random.normal((config.vocab_size, config.hidden_size)) * std).astype(dtype)
    model.head.norm.weight = mx.ones((config.hidden_size,), dtype=dtype)
    if not config.tie_word_embeddings:
        model.head.lm_head.weight = (mx.random.normal((config.vocab_size, config.hidden_size)) * std).astype(dtype)
    mx.eval(model.embed.parameters(), model.head.parameters())
    for block in model.blocks:
        _init_block(block, std, dtype)
        if quantize_bits:
            quantize_block(block, group_size, quantize_bits, compute_mode)
        mx.eval(block.parameters())
    if quantize_bits:
        quantize_model(model, quantize_bits, group_size, compute_mode)  # records the spec; blocks are done
    return model


def from_torch(torch_model: Any, dtype: str | mx.Dtype | None = None) -> MLXDecoder:
    """An MLX copy of an edgetrain torch LlamaModel (without LoRA), same weights bit for bit."""
    import torch

    config: LlamaConfig = torch_model.config
    state = {k: v for k, v in torch_model.state_dict().items()}
    if any(".lora_" in k or ".base." in k for k in state):
        raise EdgetrainError("from_torch copies a plain decoder; copy it before add_lora, then add LoRA to both")
    target = parse_mlx_dtype(dtype) if dtype is not None else None
    tensors = {}
    for key, tensor in state.items():
        array = mx.array(tensor.detach().to(torch.float32).cpu().numpy())
        tensors[key] = array.astype(target or _torch_to_mlx_dtype(tensor.dtype))
    model = MLXDecoder(config)
    assign_weights(model, tensors, "the torch model")
    return model


def _torch_to_mlx_dtype(dtype: Any) -> mx.Dtype:
    return {"torch.float32": mx.float32, "torch.bfloat16": mx.bfloat16,
            "torch.float16": mx.float16}.get(str(dtype), mx.float32)


def _read_safetensors(path: Path) -> dict[str, mx.array]:
    require_regular_file(path, CheckpointError, "a weight shard")
    try:
        return mx.load(str(path), format="safetensors")
    except (RuntimeError, ValueError, OSError) as exc:
        raise CheckpointError(f"{path}: damaged or unreadable safetensors file ({exc})") from None


def load_checkpoint_dir(directory: str | Path, dtype: str | mx.Dtype = "float32") -> MLXDecoder:
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    raw = read_config(directory)
    config = config_from_hf_dict(raw, str(directory / "config.json"))
    target = parse_mlx_dtype(dtype)
    offset = norm_offset(config)  # Gemma's checkpoints hold w of its 1 + w norms: added in float32
    tensors: dict[str, mx.array] = {}
    for path in safetensors_files(directory):
        for key, array in _read_safetensors(path).items():
            if key.endswith(_IGNORED_SUFFIXES):
                continue
            name = hf_key_to_edgetrain(key)
            if name in tensors:
                raise CheckpointError(f"{path}: tensor {key!r} appears in more than one shard")
            if offset and key.endswith("norm.weight"):
                array = array.astype(mx.float32) + offset
            tensors[name] = array.astype(target) if mx.issubdtype(array.dtype, mx.floating) else array
    model = MLXDecoder(config)
    assign_weights(model, tensors, str(directory))
    return model


def load_mlx_model(name_or_path: str | Path, *, dtype: str | mx.Dtype = "float32", seed: int = 0,
                   layers: int | None = None, quantize_bits: int | None = None,
                   group_size: int = DEFAULT_GROUP_SIZE, compute_mode: ComputeMode | None = None,
                   dequantize: bool = False) -> MLXDecoder:
    """A decoder by preset name (random init, seeded), from a Hugging Face checkpoint directory or from a
    llama.cpp GGUF file (its Q4_0 / Q4_1 / Q8_0 projections kept quantised unless `dequantize`:
    edgetrain.backends.mlx.gguf); quantize_bits=4 stores the blocks' (remaining dense) base projections in
    4 bits (group size 64)."""
    path = Path(name_or_path)
    is_gguf = path.suffix.lower() == ".gguf" and not path.is_dir()
    if path.is_dir() or is_gguf:
        if is_gguf:
            from edgetrain.backends.mlx.gguf import load_gguf_mlx

            model = load_gguf_mlx(path, dtype, compute_mode, packed=not dequantize)
        else:
            from edgetrain.data.tokenizer import attach_tokenizer

            model = load_checkpoint_dir(path, dtype)
            attach_tokenizer(model, path, model.config.vocab_size)  # its tokenizer.json, when it has one
        if layers is not None:
            if not 0 < layers <= len(model.blocks):
                raise EdgetrainError(f"layers={layers}: the model has {len(model.blocks)} blocks")
            model.blocks = model.blocks[:layers]
        if quantize_bits:
            quantize_model(model, quantize_bits, group_size, compute_mode)
        return model
    if path.exists() or "/" in str(name_or_path) or str(name_or_path).startswith("."):
        raise CheckpointError(f"{name_or_path} is not a checkpoint directory (expected a directory "
                              "with config.json and *.safetensors)")
    return build_random(preset_config(str(name_or_path)), dtype=dtype, seed=seed, layers=layers,
                        quantize_bits=quantize_bits, group_size=group_size, compute_mode=compute_mode)


def load_mlx_for_backend(name_or_path: str | Path, dtype: Any = "float32", device: Any = None,
                         quantize_bits: int | None = None) -> MLXDecoder:
    """The MLX backend's dense loader for edgetrain.load_model (a GGUF dequantised, as torch's loader
    does; load_packed_gguf_mlx keeps it packed): MLX places arrays itself, so `device` is unused;
    `quantize_bits` quantises block by block as the blocks load."""
    return load_mlx_model(name_or_path, dtype=dtype, quantize_bits=quantize_bits, dequantize=True)


def load_packed_gguf_mlx(path: str | Path, dtype: Any = "float32", device: Any = None) -> MLXDecoder:
    """The MLX backend's packed GGUF loader for edgetrain.load_model (its default for a GGUF): Q4_0, Q4_1
    and Q8_0 block projections kept as stored."""
    return load_mlx_model(path, dtype=dtype)


def to_numpy(array: mx.array) -> np.ndarray:
    """An MLX array as numpy (bf16 widened to fp32: numpy has no bfloat16)."""
    if array.dtype == mx.bfloat16:
        array = array.astype(mx.float32)
    return np.array(array)
