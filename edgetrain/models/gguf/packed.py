"""ggml block formats -> the affine group quantisation that MLX (mx.quantize) holds, without requantising.

MLX keeps w = scale * q + bias for each group of `group_size` consecutive inputs of a row, q unsigned
`bits`-bit integers packed as a little-endian bit stream into uint32 words (for 4 bits element j of a word
in bits [4j, 4j + 4); checked against mx.dequantize in tests/mlx/test_mlx_gguf.py). Its groups are 32, 64
or 128 values, so the formats of the block table (blocks.py) whose groups are 32 values and whose values
are affine in their codes map onto it, each group one MLX group:

  Q4_0, Q5_0, Q8_0   w = (c - z) * d       ->  scale d, bias -z d          (z = 8, 16, 128)
  Q4_1, Q5_1         w = c * d + m         ->  scale d, bias m
  Q4_K, Q5_K         w = c * (d s) - dmin m  ->  scale d s, bias -(dmin m)  (s, m: 6-bit sub-block steps)

In float32 mx.dequantize then gives ggml's values exactly: scale * c is exact (an f16 scale, times a step
of at most 6 bits, times a code of at most 8 bits, fits float32's 24), and the one addition after it has
ggml's exact result (the zero-point formats, whose products are representable) or rounds the same sum
ggml rounds. The only difference is the sign of a zero: c d - z d gives +0.0 where ggml's (c - z) d with
d < 0 gives -0.0. Q2_K, Q3_K and Q6_K (groups of 16) and IQ4_NL, IQ4_XS (a non-uniform grid) have no
MLX form: their matrices are dequantised on MLX (the loader logs which), and kept packed on torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgetrain.models.gguf.blocks import BLOCK_FORMATS

GROUP_SIZE = 32  # MLX's smallest group, and ggml's 32-value group


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


# The ggml types MLX keeps quantised: 32-value groups, affine in the codes.
PACKABLE_TYPES = frozenset(t for t, f in BLOCK_FORMATS.items() if f.group_size == GROUP_SIZE and f.codebook is None)


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """[n, values] unsigned integers -> [n, values * bits / 32] uint32 words of a little-endian bit stream."""
    if bits == 8:
        packed = q
    elif bits == 4:
        packed = q[:, 0::2] | (q[:, 1::2] << np.uint8(4))  # elements 2i (low) and 2i + 1 (high) share byte i
    else:
        stream = np.unpackbits(q[..., None], axis=-1, count=bits, bitorder="little")
        packed = np.packbits(stream.reshape(q.shape[0], -1), axis=-1, bitorder="little")
    return np.ascontiguousarray(packed, dtype=np.uint8).view(np.dtype("<u4")).astype(np.uint32, copy=False)


# Rows repacked at a time: the temporaries of one slice (unpacked nibbles, shifted halves, widened scales)
# stay a few MiB, where SmolLM2's whole Q4_1 token table would make ~150 MiB of them at once.
PACK_ROWS = 2048


def pack_blocks(raw: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> PackedWeight:
    """A [rows, cols] tensor's raw block bytes (ggml_type in PACKABLE_TYPES; the size checked by the
    reader) in MLX's quantised layout. Scales and biases are float32; a caller may narrow them. Rows are
    repacked PACK_ROWS at a time into the outputs, so a large matrix costs little more than its result."""
    fmt = BLOCK_FORMATS[ggml_type]
    bits = fmt.bits
    rows, cols = shape
    groups = cols // GROUP_SIZE
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, cols // fmt.block_values, fmt.block_bytes)
    weight = np.empty((rows, cols * bits // 32), dtype=np.uint32)
    scales = np.empty((rows, groups), dtype=np.float32)
    biases = np.empty((rows, groups), dtype=np.float32)
    for start in range(0, rows, PACK_ROWS):
        stop = min(start + PACK_ROWS, rows)
        with np.errstate(all="ignore"):  # non-finite scales are the caller's check (all_finite)
            parts = fmt.split(blocks[start:stop].reshape(-1, fmt.block_bytes))
            scale = parts.group_scales().reshape(stop - start, groups)
            bias = (np.float32(-fmt.zero_point) * scale if fmt.zero_point is not None
                    else parts.group_biases(fmt.subtracts_bias).reshape(stop - start, groups))
        weight[start:stop] = _pack(parts.codes.reshape(stop - start, cols), bits)
        scales[start:stop] = scale
        biases[start:stop] = bias
    return PackedWeight(weight, scales, biases, bits)


def all_finite(packed: PackedWeight) -> bool:
    """Whether every weight is finite: it is exactly when every scale and bias is (a finite f16 scale times
    q <= 255 stays far inside float32; a NaN or infinite d makes its whole block NaN or infinite, q = 0
    included), so the weights need not be dequantised to be checked."""
    return bool(np.isfinite(packed.scales).all() and np.isfinite(packed.biases).all())
