"""Dequantising ggml tensors to float32 in numpy: the float types F32, F16 and BF16, and every block
format of the table in blocks.py (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ4_NL, IQ4_XS), in ggml's
arithmetic, so results equal ggml's bit for bit. A type not here is refused by the loaders, by name.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from edgetrain.models.gguf.blocks import BLOCK_FORMATS
from edgetrain.models.gguf.ggml_types import GGML_TYPES

# Rows of blocks dequantised at a time: the temporaries of one slice (codes, steps, widened scales) stay a
# few MiB whatever the tensor.
_BLOCKS_AT_ONCE = 1 << 14


def _f32(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.dtype("<f4")).astype(np.float32)


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.dtype("<f2")).astype(np.float32)


def _bf16(raw: np.ndarray) -> np.ndarray:
    # bfloat16 is the top half of a float32: widening is a shift, exact for every value incl. NaN payloads.
    return (raw.view(np.dtype("<u2")).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _blocks(type_id: int) -> Callable[[np.ndarray], np.ndarray]:
    block_format = BLOCK_FORMATS[type_id]

    def dequantize_blocks(raw: np.ndarray) -> np.ndarray:
        blocks = raw.reshape(-1, block_format.block_bytes)
        out = np.empty(blocks.shape[0] * block_format.block_values, dtype=np.float32)
        step = _BLOCKS_AT_ONCE
        for start in range(0, blocks.shape[0], step):
            stop = min(start + step, blocks.shape[0])
            out[start * block_format.block_values:stop * block_format.block_values] = \
                block_format.dequantize(blocks[start:stop])
        return out

    return dequantize_blocks


DEQUANTIZERS: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    0: _f32, 1: _f16, 30: _bf16, **{type_id: _blocks(type_id) for type_id in BLOCK_FORMATS},
}
SUPPORTED_TYPE_NAMES = [GGML_TYPES[t][0] for t in DEQUANTIZERS]


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of shape `shape` from a tensor's raw bytes (a uint8 array of the exact size).

    The caller checks that `ggml_type` is in DEQUANTIZERS and that the size matches the shape."""
    # Inf or NaN scales (a damaged file) warn in numpy; the loader refuses non-finite weights by name.
    with np.errstate(all="ignore"):
        return DEQUANTIZERS[ggml_type](np.asarray(raw, dtype=np.uint8)).reshape(shape)
