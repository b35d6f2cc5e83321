"""llama.cpp GGUF files -> MLXDecoder, with the block formats MLX can hold kept quantised.

The torch loader's reader, metadata checks, tensor plan, Q/K row order and tokenizer
(edgetrain.models.gguf.loader), so both refuse the same files with the same GGUFError; what differs is
what a tensor becomes:

  block projections (attn_q/k/v/output, ffn_gate/up/down)
      Q4_0, Q4_1, Q4_K QuantizedLinear, 4 bits, group 32: the file's integers and scales, not requantised
      Q5_0, Q5_1, Q5_K QuantizedLinear, 5 bits, group 32
      Q8_0             QuantizedLinear, 8 bits, group 32 (edgetrain/models/gguf/packed.py has the mapping)
      Q2_K, Q3_K, Q6_K, IQ4_NL, IQ4_XS
                       nn.Linear in the requested dtype, dequantised (logged: MLX groups are 32 values or
                       more, and affine; these have groups of 16 or a non-uniform grid)
      F32, F16, BF16   nn.Linear in the requested dtype
  token embedding, LM head (output.weight)
      any type         dense in the requested dtype: dequantised when stored quantised (logged). The
                       decoder's LM head multiplies by the embedding matrix itself when they are tied,
                       and MeSP's chunked loss slices its rows, so it is dense, as quantize_model keeps it
  norms, biases        dense in the requested dtype

Scales and biases are held in the requested dtype: exact in float32 (mx.dequantize then equals the
torch loader's dequantised weights), the 32-value formats' f16 scales exact in float16 (a k-quant's scale
times its sub-block step is not), rounded to 8 bits in bfloat16.
"""
from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from edgetrain.models.gguf.packed import PACKABLE_TYPES, PackedWeight, all_finite, pack_blocks
from edgetrain.backends.mlx.lora import resolve_path
from edgetrain.backends.mlx.model import MLXDecoder
from edgetrain.backends.mlx.quantize import BLOCK_LINEARS, ComputeMode, QuantizedLinear, default_compute_mode
from edgetrain.backends.mlx.weights import assign_weights, parse_mlx_dtype
from edgetrain.utils.logs import get_logger
from edgetrain.models.gguf.config import config_from_metadata
from edgetrain.models.gguf.loader import (DENSE_TYPES, attach_gguf_tokenizer, plan_tensors, read_values, rope_row_order,
                                          take_gguf_tokenizer)
from edgetrain.models.gguf.reader import GGUFError, GGUFFile, TensorInfo, read_gguf

log = get_logger(__name__)

_BLOCK_LINEAR = re.compile(r"blocks\.(\d+)\.(" + "|".join(re.escape(p) for p in BLOCK_LINEARS) + r")")


def _packed(gguf: GGUFFile, info: TensorInfo, order: np.ndarray | None) -> PackedWeight:
    packed = pack_blocks(gguf.tensor_bytes(info), info.ggml_type, info.shape)
    gguf.release(info)  # repacked into new arrays: the file's pages need not stay resident
    if not all_finite(packed):  # the torch loader's check and words, without dequantising
        raise GGUFError(f"{gguf.path}: tensor {info.name!r} holds NaN or infinite values")
    return packed if order is None else packed.rows(order)


def _install_quantized(model: MLXDecoder, block: int, path: str, packed: PackedWeight,
                       compute_mode: ComputeMode) -> None:
    """Swap the dense projection at blocks[block].<path> for an empty QuantizedLinear of its shape; its
    arrays are assigned with the rest (its constructor's random ones are lazy and never evaluated)."""
    parent, attr = resolve_path(model.blocks[block], path)
    dense = getattr(parent, attr)
    out_features, in_features = dense.weight.shape
    layer = QuantizedLinear(in_features, out_features, bias="bias" in dense, group_size=packed.group_size,
                            bits=packed.bits)
    layer.compute_mode = compute_mode
    setattr(parent, attr, layer)


def load_gguf_mlx(path: str | Path, dtype: str | mx.Dtype = "float32",
                  compute_mode: ComputeMode | None = None, *, packed: bool = True) -> MLXDecoder:
    """A llama / qwen2 MLXDecoder from a GGUF file: block projections in a format MLX holds stay quantised
    (see the module docstring), everything else is dense in `dtype`; `packed=False` holds every weight
    dense in `dtype` (edgetrain.backends.load_options: --dequantize). The file's byte-level BPE
    vocabulary, when it has one, becomes `model.tokenizer`, as with the torch loader."""
    gguf = read_gguf(path)
    config = config_from_metadata(gguf)
    tokenizer = take_gguf_tokenizer(gguf)  # before the model: see its docstring
    target = parse_mlx_dtype(dtype)
    mode = compute_mode or default_compute_mode()
    model = MLXDecoder(config)  # its random arrays are lazy: all are replaced before any is evaluated
    expected = {name: tuple(array.shape) for name, array in tree_flatten(model.parameters())}
    tensors: dict[str, mx.array] = {}
    dequantised: list[str] = []
    for gguf_name, (name, info) in plan_tensors(gguf, config, expected).items():
        order = rope_row_order(config, gguf_name, info.shape[0])
        module, _, kind = name.rpartition(".")
        linear = _BLOCK_LINEAR.fullmatch(module)
        if packed and kind == "weight" and linear and info.ggml_type in PACKABLE_TYPES:
            packed = _packed(gguf, info, order)
            _install_quantized(model, int(linear.group(1)), linear.group(2), packed, mode)
            tensors[f"{module}.weight"] = mx.array(packed.weight)
            tensors[f"{module}.scales"] = mx.array(packed.scales).astype(target)
            tensors[f"{module}.biases"] = mx.array(packed.biases).astype(target)
            continue
        values = read_values(gguf, info)
        if packed and info.type_name not in DENSE_TYPES:
            dequantised.append(f"{gguf_name} ({info.type_name})")
        tensors[name] = mx.array(values if order is None else values[order]).astype(target)
    if dequantised:
        # One line per load: what a reader of the memory figures needs to know is held densely.
        log.info("%s: dequantised to %s on MLX (the embedding and LM head are dense): %s", gguf.path,
                 target, ", ".join(dequantised))
    assign_weights(model, tensors, str(gguf.path))
    attach_gguf_tokenizer(model, tokenizer)
    return model
