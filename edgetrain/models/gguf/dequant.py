"""Dequantising ggml tensors to float32 in numpy: F32, F16, BF16 and the block formats Q8_0, Q4_0, Q4_1.

Block layouts (ggml-common.h), 32 values per block, the f16 scales little-endian:
  Q8_0: d (f16), 32 x int8 q             value = q * d
  Q4_0: d (f16), 16 bytes of nibbles     value = (q - 8) * d
  Q4_1: d (f16), m (f16), 16 nibbles     value = q * d + m
A nibble byte j holds element j in its low 4 bits and element j + 16 in its high 4 bits.
The arithmetic is float32 in the order ggml writes it, so results equal ggml's bit for bit.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from edgetrain.models.gguf.ggml_types import GGML_TYPES

_F16 = np.dtype("<f2")
_BLOCK = 32


def block_scale(column: np.ndarray) -> np.ndarray:
    """Two bytes per block -> the f16 they hold, widened to float32, shape [blocks, 1]."""
    return np.ascontiguousarray(column).view(_F16).astype(np.float32)


def nibbles(packed: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes -> [blocks, 32] values 0..15: low nibbles first, then high nibbles."""
    return np.concatenate([packed & np.uint8(0x0F), packed >> np.uint8(4)], axis=1)


def _f32(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.dtype("<f4")).astype(np.float32)


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(_F16).astype(np.float32)


def _bf16(raw: np.ndarray) -> np.ndarray:
    # bfloat16 is the top half of a float32: widening is a shift, exact for every value incl. NaN payloads.
    return (raw.view(np.dtype("<u2")).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _q8_0(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 2 + _BLOCK)
    return blocks[:, 2:].view(np.int8).astype(np.float32) * block_scale(blocks[:, :2])


def _q4_0(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 2 + _BLOCK // 2)
    q = nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8)
    return block_scale(blocks[:, :2]) * q.astype(np.float32)


def _q4_1(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 4 + _BLOCK // 2)
    q = nibbles(blocks[:, 4:]).astype(np.float32)
    return block_scale(blocks[:, :2]) * q + block_scale(blocks[:, 2:4])


DEQUANTIZERS: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    0: _f32, 1: _f16, 30: _bf16, 8: _q8_0, 2: _q4_0, 3: _q4_1,
}
SUPPORTED_TYPE_NAMES = [GGML_TYPES[t][0] for t in DEQUANTIZERS]


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of shape `shape` from a tensor's raw bytes (a uint8 array of the exact size).

    The caller checks that `ggml_type` is in DEQUANTIZERS and that the size matches the shape."""
    # Inf or NaN scales (a damaged file) warn in numpy; the loader refuses non-finite weights by name.
    with np.errstate(all="ignore"):
        return DEQUANTIZERS[ggml_type](np.asarray(raw, dtype=np.uint8)).reshape(shape)
