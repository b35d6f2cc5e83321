"""Model zoo: presets by name, checkpoints by path; every model exposes embed / blocks / head."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

# Importing a model module registers its presets.
from edgetrain.models import (convnet, decoder_presets, lstm, mlp, mobilenet, resnet,  # noqa: F401
                              text_transformer, vit)
from edgetrain.models.hf_checkpoint import CheckpointError, load_checkpoint_dir
from edgetrain.models.llama import ConfigError, LlamaConfig, LlamaModel
from edgetrain.models.zoo import ARCHITECTURES, MODEL_PRESETS, run_blocks
from edgetrain.registry import EdgetrainError

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise EdgetrainError(f"unknown dtype {dtype!r}; known: {', '.join(_DTYPES)}") from None


def load_model(name_or_path: str | Path, backend: str = "torch", dtype: str | torch.dtype = torch.float32,
               device: str | torch.device | None = None) -> nn.Module:
    """A model by preset name (random init) or from a Hugging Face-format checkpoint directory.
    backend="mlx" gives the MLX decoder (edgetrain.backends.mlx.loading.load_mlx_model; `device` unused)."""
    if backend == "mlx":
        from edgetrain.backends import get_backend

        get_backend("mlx")  # says why not (mlx missing) before importing it
        from edgetrain.backends.mlx.loading import load_mlx_model

        return load_mlx_model(name_or_path, dtype=dtype)
    if backend not in ("torch", "torch-cpu", "torch-cuda"):
        raise EdgetrainError(f"load_model: unknown backend {backend!r}; known: torch, torch-cpu, torch-cuda, mlx")
    dtype = parse_dtype(dtype)
    if device is None:
        device = "cuda" if backend == "torch-cuda" else "cpu"
    path = Path(name_or_path)
    if path.is_dir():
        return load_checkpoint_dir(path, dtype=dtype, device=device)
    if str(name_or_path) in MODEL_PRESETS:
        model = MODEL_PRESETS.get(str(name_or_path))()
        return model.to(device=device, dtype=dtype)
    if path.exists() or "/" in str(name_or_path) or str(name_or_path).startswith("."):
        raise CheckpointError(f"{name_or_path} is not a checkpoint directory (expected a directory "
                              "with config.json and *.safetensors)")
    raise EdgetrainError(f"unknown model {str(name_or_path)!r}: not a directory and not a preset; "
                         f"known presets: {', '.join(MODEL_PRESETS.names())}")


__all__ = ["ARCHITECTURES", "MODEL_PRESETS", "CheckpointError", "ConfigError", "LlamaConfig",
           "LlamaModel", "load_model", "parse_dtype", "run_blocks"]
