"""ggml blocks -> the row layout of torch's packed matrices (edgetrain.models.quantized.PackedMatrix),
for every format of the table in blocks.py, without requantising.

A [rows, cols] tensor's codes become bit planes along each row: a low plane of 2, 4 or 8 bits a value and,
for 3-, 5- and 6-bit codes, a high plane of 1 or 2 bits (code = low | high << low_bits). A plane of k bits
holds 8 / k values a byte, column (8 / k) i + t in bits [k t, k (t + 1)) of byte i: for 4 bits MLX's and
the earlier layout (columns 2i, 2i + 1 in the low and high nibble). The scales stay as the file has them:
one f16 a block (`scales` [rows, blocks]) and, for the k-quants, each group's integer step
(`scale_steps` [rows, groups]); likewise the biases. So the resident bytes are the file's, give or take a
byte a group: Q4_K's 4.5 bits a weight are 4.625 here.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from edgetrain.models.gguf.blocks import BLOCK_FORMATS, BlockFormat

# Rows split at a time: the temporaries of one slice (codes a byte each, widened steps) stay a few MiB.
SPLIT_ROWS = 1024


def plane_bits(bits: int) -> tuple[int, int]:
    """(low plane bits, high plane bits) of `bits`-bit codes; high is 0 when there is no high plane."""
    low = {2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 8: 8}[bits]
    return low, bits - low


def pack_plane(values: np.ndarray, bits: int) -> np.ndarray:
    """[rows, cols] unsigned values < 2**bits -> [rows, cols * bits / 8] bytes (the layout above)."""
    if bits == 8:
        return np.ascontiguousarray(values, dtype=np.uint8)
    per_byte = 8 // bits
    grouped = values.reshape(values.shape[0], -1, per_byte).astype(np.uint8)
    packed = np.zeros(grouped.shape[:2], dtype=np.uint8)
    for t in range(per_byte):
        packed |= grouped[:, :, t] << np.uint8(bits * t)
    return packed


def unpack_plane(packed: np.ndarray, bits: int) -> np.ndarray:
    """pack_plane's inverse: [rows, bytes] -> [rows, bytes * 8 / bits]."""
    if bits == 8:
        return packed
    per_byte = 8 // bits
    mask = np.uint8((1 << bits) - 1)
    return np.stack([(packed >> np.uint8(bits * t)) & mask for t in range(per_byte)], axis=-1).reshape(
        packed.shape[0], -1)


@dataclass(frozen=True)
class PackedRows:
    """A [rows, cols] matrix in PackedMatrix's layout (see the module docstring)."""
    format: BlockFormat
    codes: np.ndarray               # uint8 [rows, cols * low_bits / 8]
    high_codes: np.ndarray | None   # uint8 [rows, cols * high_bits / 8]
    scales: np.ndarray              # float16 [rows, cols / block_values]
    scale_steps: np.ndarray | None  # int8 [rows, cols / group_size]
    biases: np.ndarray | None       # float16 [rows, cols / block_values]
    bias_steps: np.ndarray | None   # uint8 [rows, cols / group_size]

    @property
    def shape(self) -> tuple[int, int]:
        low_bits, _ = plane_bits(self.format.bits)
        return self.codes.shape[0], self.codes.shape[1] * 8 // low_bits

    def rows(self, order: np.ndarray) -> "PackedRows":
        """The same matrix with its rows in `order`: everything runs along a row, so rows move whole."""
        return replace(self, **{name: None if getattr(self, name) is None else getattr(self, name)[order]
                                for name in ("codes", "high_codes", "scales", "scale_steps", "biases",
                                             "bias_steps")})

    def all_finite(self) -> bool:
        """Whether every weight is finite: exactly when every f16 scale and bias is (a finite scale times
        an integer step and a code stays far inside float32; a NaN or infinite one spoils its block)."""
        return bool(np.isfinite(self.scales).all() and (self.biases is None or np.isfinite(self.biases).all()))

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.codes, self.high_codes, self.scales, self.scale_steps, self.biases,
                                      self.bias_steps) if a is not None)


def split_rows(raw: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> PackedRows:
    """A [rows, cols] tensor's raw block bytes (ggml_type in BLOCK_FORMATS; the size checked by the reader)
    in PackedMatrix's layout, SPLIT_ROWS rows at a time into the outputs."""
    fmt = BLOCK_FORMATS[ggml_type]
    rows, cols = shape
    blocks_per_row, groups = cols // fmt.block_values, cols // fmt.group_size
    low_bits, high_bits = plane_bits(fmt.bits)
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, blocks_per_row, fmt.block_bytes)
    codes = np.empty((rows, cols * low_bits // 8), dtype=np.uint8)
    high = np.empty((rows, cols * high_bits // 8), dtype=np.uint8) if high_bits else None
    scales = np.empty((rows, blocks_per_row), dtype=np.float16)
    biases = np.empty((rows, blocks_per_row), dtype=np.float16) if fmt.has_bias else None
    scale_steps = bias_steps = None
    for start in range(0, rows, SPLIT_ROWS):
        stop = min(start + SPLIT_ROWS, rows)
        parts = fmt.split(blocks[start:stop].reshape(-1, fmt.block_bytes))
        values = parts.codes.reshape(stop - start, cols)
        codes[start:stop] = pack_plane(values & np.uint8((1 << low_bits) - 1), low_bits)
        if high is not None:
            high[start:stop] = pack_plane(values >> np.uint8(low_bits), high_bits)
        # The f16 fields widened exactly; narrowing back is exact too.
        scales[start:stop] = parts.scale.reshape(stop - start, blocks_per_row).astype(np.float16)
        if parts.scale_steps is not None:
            if scale_steps is None:
                scale_steps = np.empty((rows, groups), dtype=np.int8)
            scale_steps[start:stop] = parts.scale_steps.reshape(stop - start, groups)
        if biases is not None:
            biases[start:stop] = parts.bias.reshape(stop - start, blocks_per_row).astype(np.float16)
            if parts.bias_steps is not None:
                if bias_steps is None:
                    bias_steps = np.empty((rows, groups), dtype=np.uint8)
                bias_steps[start:stop] = parts.bias_steps.reshape(stop - start, groups)
    return PackedRows(fmt, codes, high, scales, scale_steps, biases, bias_steps)


def dequantize_rows(packed: PackedRows) -> np.ndarray:
    """float32 [rows, cols] from PackedRows, in ggml's arithmetic (a check of the layout, and what a path
    that cannot keep a format packed computes)."""
    fmt = packed.format
    rows, cols = packed.shape
    low_bits, high_bits = plane_bits(fmt.bits)
    codes = unpack_plane(packed.codes, low_bits)
    if packed.high_codes is not None:
        codes = codes | (unpack_plane(packed.high_codes, high_bits) << np.uint8(low_bits))
    per_block = fmt.groups_per_block
    scales = np.repeat(packed.scales.astype(np.float32), per_block, axis=1)
    if packed.scale_steps is not None:
        scales = scales * packed.scale_steps.astype(np.float32)
    grouped = codes.reshape(rows, -1, fmt.group_size)
    if fmt.codebook is not None:
        values = fmt.codebook.astype(np.float32)[grouped] * scales[..., None]
    elif fmt.zero_point is not None:
        values = (grouped.astype(np.float32) - np.float32(fmt.zero_point)) * scales[..., None]
    else:
        biases = np.repeat(packed.biases.astype(np.float32), per_block, axis=1)
        if packed.bias_steps is not None:
            biases = biases * packed.bias_steps.astype(np.float32)
        if fmt.subtracts_bias:
            biases = -biases  # after the product, as BlockParts.group_biases
        values = grouped.astype(np.float32) * scales[..., None] + biases[..., None]
    return values.reshape(rows, cols)
