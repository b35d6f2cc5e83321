"""ggml block formats -> the affine group quantisation that MLX (mx.quantize) and edgetrain's torch
QuantizedLinear hold, without requantising.

MLX keeps w = scale * q + bias for each group of `group_size` consecutive inputs of a row, q unsigned
`bits`-bit integers packed little-endian into uint32 words (element j of a word in bits
[bits * j, bits * (j + 1)); checked against mx.dequantize in tests/mlx/test_mlx_gguf.py). ggml's
32-value blocks run along a row's inputs too, so each block is one MLX group of 32:

  Q4_0  d, 16 nibble bytes      w = d * (q - 8)  ->  4 bits, scale d, bias -8 d
  Q4_1  d, m, 16 nibble bytes   w = d * q + m    ->  4 bits, scale d, bias m
  Q8_0  d, 32 x int8 q          w = d * q        ->  8 bits, scale d, bias -128 d, q + 128 stored

Only the integers are moved: ggml's byte j holds elements j (low nibble) and j + 16 (high), MLX's byte i
elements 2i and 2i + 1. In float32 mx.dequantize then gives ggml's values exactly: d * q is exact (an
11-bit f16 scale times a small integer) and the one addition after it has ggml's exact result (Q4_0,
Q8_0: d * (q - 8) and d * q are representable) or rounds the same sum ggml rounds (Q4_1). The only
difference is the sign of a zero: d * 0 - 8 d gives +0.0 where ggml's d * 0 with d < 0 gives -0.0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from edgetrain.models.gguf.dequant import block_scale, nibbles

GROUP_SIZE = 32  # ggml's block of Q4_0, Q4_1 and Q8_0


@dataclass(frozen=True)
class PackedWeight:
    """A [rows, cols] weight in MLX's quantised layout (what nn.QuantizedLinear holds)."""
    weight: np.ndarray   # uint32 [rows, cols * bits / 32]
    scales: np.ndarray   # float32 [rows, cols / 32]
    biases: np.ndarray   # float32 [rows, cols / 32]
    bits: int
    group_size: int = GROUP_SIZE

    def rows(self, order: np.ndarray) -> "PackedWeight":
        """The same weight with its rows in `order`: packing runs along a row, so rows move whole."""
        return PackedWeight(self.weight[order], self.scales[order], self.biases[order], self.bits, self.group_size)


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = block_scale(blocks[:, :2])
    return nibbles(blocks[:, 2:]), d, -8.0 * d  # ggml's q - 8 is MLX's q with a bias of -8 d


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return nibbles(blocks[:, 4:]), block_scale(blocks[:, :2]), block_scale(blocks[:, 2:4])


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = block_scale(blocks[:, :2])
    # int8 q -> unsigned q + 128: flipping the sign bit is that addition, mod 256.
    return blocks[:, 2:] ^ np.uint8(0x80), d, -128.0 * d


# ggml type id -> (bits, bytes per block, block -> (q [blocks, 32] uint8, scale [blocks, 1], bias [blocks, 1]))
_FORMATS: dict[int, tuple[int, int, Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]]] = {
    2: (4, 2 + 16, _q4_0),
    3: (4, 2 + 2 + 16, _q4_1),
    8: (8, 2 + 32, _q8_0),
}
PACKABLE_TYPES = frozenset(_FORMATS)  # the ggml types MLX keeps quantised


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """[blocks, 32] unsigned integers -> [blocks, 32 * bits / 32] little-endian uint32 words."""
    if bits == 4:
        q = q[:, 0::2] | (q[:, 1::2] << np.uint8(4))  # elements 2i (low) and 2i + 1 (high) share byte i
    return np.ascontiguousarray(q, dtype=np.uint8).view(np.dtype("<u4")).astype(np.uint32, copy=False)


# Rows repacked at a time: the temporaries of one slice (unpacked nibbles, shifted halves, widened scales)
# stay a few MiB, where SmolLM2's whole Q4_1 token table would make ~150 MiB of them at once.
PACK_ROWS = 2048


def pack_blocks(raw: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> PackedWeight:
    """A [rows, cols] tensor's raw block bytes (ggml_type in PACKABLE_TYPES; the size checked by the
    reader) in MLX's quantised layout. Scales and biases are float32; a caller may narrow them. Rows are
    repacked PACK_ROWS at a time into the outputs, so a large matrix costs little more than its result."""
    bits, block_bytes, split = _FORMATS[ggml_type]
    rows, cols = shape
    groups = cols // GROUP_SIZE
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, groups, block_bytes)
    weight = np.empty((rows, cols * bits // 32), dtype=np.uint32)
    scales = np.empty((rows, groups), dtype=np.float32)
    biases = np.empty((rows, groups), dtype=np.float32)
    for start in range(0, rows, PACK_ROWS):
        stop = min(start + PACK_ROWS, rows)
        with np.errstate(all="ignore"):  # non-finite scales are the caller's check (all_finite)
            q, scale, bias = split(blocks[start:stop].reshape(-1, block_bytes))
        weight[start:stop] = _pack(q, bits).reshape(stop - start, -1)
        scales[start:stop] = scale.reshape(stop - start, groups)
        biases[start:stop] = bias.reshape(stop - start, groups)
    return PackedWeight(weight, scales, biases, bits)


def all_finite(packed: PackedWeight) -> bool:
    """Whether every weight is finite: it is exactly when every scale and bias is (a finite f16 scale times
    q <= 255 stays far inside float32; a NaN or infinite d makes its whole block NaN or infinite, q = 0
    included), so the weights need not be dequantised to be checked."""
    return bool(np.isfinite(packed.scales).all() and np.isfinite(packed.biases).all())
