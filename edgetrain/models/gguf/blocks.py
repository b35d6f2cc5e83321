"""The one table of ggml block formats that every path reads: numpy dequantisation (dequant.py), MLX's
packed layout (packed.py), torch's packed matrices (edgetrain.models.quantized) and the listing of what
each path does with a type (`edgetrain list`).

Every format here is, value by value, an integer code times a scale, shifted either by a zero point or a
bias, in groups of `group_size` consecutive values of a row:

    zero point    w = (c - zero_point) * scale          Q4_0, Q5_0, Q8_0, Q3_K, Q6_K
    bias          w = c * scale + bias                  Q4_1, Q5_1, Q2_K, Q4_K, Q5_K
    codebook      w = codebook[c] * scale               IQ4_NL, IQ4_XS

and a group's scale (and bias) is a block's f16 scale times a small integer step of the group's: one
step of 1 for the 32-value formats, ggml's 4-, 6- or 8-bit sub-block scales for the k-quants (their
super-block of 256 holds 8 groups of 32 or 16 of 16). A step is at most 8 bits and an f16 scale 11, so
the product is exact in float32, and the one or two roundings after it are the ones ggml's own
dequantize_row_* makes in the same order: values equal ggml's bit for bit (gguf-py's numpy port is the
test oracle, tests/models/test_gguf_blocks.py). A minimum that ggml subtracts (Q2_K, Q4_K, Q5_K) is added
negated: x - y and x + (-y) round alike in IEEE arithmetic, signed zeros included.

A `split` takes [blocks, block_bytes] uint8 and returns the BlockParts in value order; everything else is
derived from it. Layouts are ggml-common.h's; the comments give the byte ranges of one block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

_F16 = np.dtype("<f2")
QK_K = 256  # the k-quants' super-block
# IQ4_NL's and IQ4_XS's 16 levels (ggml-common.h kvalues_iq4nl): a non-uniform 4-bit grid.
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


@dataclass(frozen=True)
class BlockParts:
    """One run of blocks taken apart (n blocks of `values` values in `groups` groups each)."""
    codes: np.ndarray               # uint8 [n, values]: unsigned codes < 2**bits, in value order
    scale: np.ndarray               # float32 [n, 1]: the block's f16 scale, widened
    scale_steps: np.ndarray | None  # int8 [n, groups]: each group's integer multiple of it (None: 1)
    bias: np.ndarray | None         # float32 [n, 1]: the block's f16 bias (or minimum), widened
    bias_steps: np.ndarray | None   # uint8 [n, groups]: each group's integer multiple of it (None: 1)

    def group_scales(self) -> np.ndarray:
        """float32 [n, groups]: exact (an f16 times an integer of at most 8 bits)."""
        return self.scale if self.scale_steps is None else self.scale * self.scale_steps.astype(np.float32)

    def group_biases(self, subtracts: bool) -> np.ndarray | None:
        """float32 [n, groups], negated when ggml subtracts them (BlockFormat.subtracts_bias)."""
        if self.bias is None:
            return None
        biases = self.bias if self.bias_steps is None else self.bias * self.bias_steps.astype(np.float32)
        # Negated after the product: -(m * d) keeps the sign of a zero that ggml's subtraction sees.
        return -biases if subtracts else biases


@dataclass(frozen=True)
class BlockFormat:
    """A ggml block type as the paths see it."""
    name: str
    type_id: int
    block_values: int
    block_bytes: int
    bits: int                      # code width
    group_size: int                # values sharing one scale (and bias)
    split: Callable[[np.ndarray], BlockParts]
    zero_point: int | None = None  # w = (c - zero_point) * scale
    codebook: np.ndarray | None = None  # w = codebook[c] * scale (int8 levels)
    subtracts_bias: bool = False   # w = c * scale - bias: ggml's minimum of the k-quants

    @property
    def groups_per_block(self) -> int:
        return self.block_values // self.group_size

    @property
    def has_bias(self) -> bool:
        return self.zero_point is None and self.codebook is None

    def dequantize(self, raw: np.ndarray) -> np.ndarray:
        """float32 values of whole blocks (raw: uint8, a multiple of block_bytes), ggml's arithmetic."""
        parts = self.split(np.asarray(raw, dtype=np.uint8).reshape(-1, self.block_bytes))
        blocks = parts.codes.shape[0]
        codes = parts.codes.reshape(blocks, self.groups_per_block, self.group_size)
        scales = parts.group_scales().reshape(blocks, -1, 1)
        if self.codebook is not None:
            values = self.codebook.astype(np.float32)[codes] * scales
        elif self.zero_point is not None:
            values = (codes.astype(np.float32) - np.float32(self.zero_point)) * scales
        else:
            values = codes.astype(np.float32) * scales + parts.group_biases(self.subtracts_bias).reshape(blocks, -1, 1)
        return values.reshape(-1)


def f16(column: np.ndarray) -> np.ndarray:
    """Two bytes per block -> the f16 they hold, widened to float32, shape [blocks, 1]."""
    return np.ascontiguousarray(column).view(_F16).astype(np.float32)


def nibbles(packed: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes -> [blocks, 32] values 0..15: low nibbles first, then high nibbles (ggml's
    32-value blocks: byte j holds element j and element j + 16)."""
    return np.concatenate([packed & np.uint8(0x0F), packed >> np.uint8(4)], axis=1)


def _bits_of(words: np.ndarray, count: int) -> np.ndarray:
    """[n, bytes] -> [n, count] bits, bit e of the little-endian bytes at column e."""
    return np.unpackbits(words, axis=1, count=count, bitorder="little")


# -- the 32-value formats -------------------------------------------------------------------------

def _q4_0(b: np.ndarray) -> BlockParts:  # d [0:2], nibbles [2:18]
    return BlockParts(nibbles(b[:, 2:]), f16(b[:, :2]), None, None, None)


def _q4_1(b: np.ndarray) -> BlockParts:  # d [0:2], m [2:4], nibbles [4:20]
    return BlockParts(nibbles(b[:, 4:]), f16(b[:, :2]), None, f16(b[:, 2:4]), None)


def _q5_0(b: np.ndarray) -> BlockParts:  # d [0:2], high bits [2:6] (bit e: element e), nibbles [6:22]
    return BlockParts(nibbles(b[:, 6:]) | (_bits_of(b[:, 2:6], 32) << np.uint8(4)), f16(b[:, :2]), None, None, None)


def _q5_1(b: np.ndarray) -> BlockParts:  # d [0:2], m [2:4], high bits [4:8], nibbles [8:24]
    return BlockParts(nibbles(b[:, 8:]) | (_bits_of(b[:, 4:8], 32) << np.uint8(4)), f16(b[:, :2]), None,
                      f16(b[:, 2:4]), None)


def _q8_0(b: np.ndarray) -> BlockParts:  # d [0:2], int8 [2:34]; int8 q -> q + 128 flips the sign bit
    return BlockParts(b[:, 2:] ^ np.uint8(0x80), f16(b[:, :2]), None, None, None)


def _iq4_nl(b: np.ndarray) -> BlockParts:  # d [0:2], nibbles [2:18] indexing IQ4_LEVELS
    return BlockParts(nibbles(b[:, 2:]), f16(b[:, :2]), None, None, None)


# -- the k-quants (256 values a super-block) -------------------------------------------------------

def _scale_min_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's / Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit minimums (ggml's get_scale_min_k4)."""
    q = packed.astype(np.uint8)
    scales = np.concatenate([q[:, 0:4] & 63, (q[:, 8:12] & 0xF) | ((q[:, 0:4] >> 6) << 4)], axis=1)
    minimums = np.concatenate([q[:, 4:8] & 63, (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)], axis=1)
    return scales, minimums


def _halves_of_64(low_bytes: np.ndarray) -> np.ndarray:
    """[n, 128] bytes -> [n, 256] nibbles: each 32 bytes give 64 values, low nibbles then high."""
    chunks = low_bytes.reshape(-1, 4, 1, 32)
    return np.concatenate([chunks & np.uint8(0x0F), chunks >> np.uint8(4)], axis=2).reshape(-1, QK_K)


def _q4_k(b: np.ndarray) -> BlockParts:  # d [0:2], dmin [2:4], scales [4:16], nibbles [16:144]
    scales, minimums = _scale_min_k4(b[:, 4:16])
    return BlockParts(_halves_of_64(b[:, 16:144]), f16(b[:, 0:2]), scales.astype(np.int8), f16(b[:, 2:4]),
                      minimums)


def _q5_k(b: np.ndarray) -> BlockParts:  # d [0:2], dmin [2:4], scales [4:16], high bits [16:48], nibbles [48:176]
    scales, minimums = _scale_min_k4(b[:, 4:16])
    # Value 64c + l takes bit 2c of high byte l, value 64c + 32 + l bit 2c + 1.
    high = _bits_of(b[:, 16:48], 256).reshape(-1, 32, 8).transpose(0, 2, 1).reshape(-1, QK_K)
    return BlockParts(_halves_of_64(b[:, 48:176]) | (high << np.uint8(4)), f16(b[:, 0:2]), scales.astype(np.int8),
                      f16(b[:, 2:4]), minimums)


def _q6_k(b: np.ndarray) -> BlockParts:  # low nibbles [0:128], high pairs [128:192], int8 scales [192:208], d [208:210]
    low = b[:, 0:128].reshape(-1, 2, 2, 32)        # [half, which 32 bytes, l]
    high = b[:, 128:192].reshape(-1, 2, 1, 32)     # [half, -, l]
    shifts = np.arange(4, dtype=np.uint8).reshape(1, 1, 4, 1) * np.uint8(2)
    high_pairs = (high >> shifts) & np.uint8(3)    # [half, k, l]: quarter k of the half
    nibble = np.concatenate([low & np.uint8(0x0F), low >> np.uint8(4)], axis=2)  # [half, k, l]
    codes = (nibble | (high_pairs << np.uint8(4))).reshape(-1, QK_K)
    return BlockParts(codes, f16(b[:, 208:210]), b[:, 192:208].view(np.int8), None, None)


def _two_bit_quarters(packed: np.ndarray) -> np.ndarray:
    """[n, 64] bytes -> [n, 256] 2-bit values: per 128-value half, 32 bytes shifted by 0, 2, 4, 6 give
    its four 32-value quarters."""
    halves = packed.reshape(-1, 2, 1, 32)
    shifts = np.arange(4, dtype=np.uint8).reshape(1, 1, 4, 1) * np.uint8(2)
    return ((halves >> shifts) & np.uint8(3)).reshape(-1, QK_K)


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes -> 16 six-bit scales minus 32 (ggml's kmask shuffle, byte by byte)."""
    s = packed.astype(np.uint8)
    low = np.concatenate([s[:, 0:8] & 0xF, s[:, 0:8] >> 4], axis=1)
    high = np.concatenate([(s[:, 8:12] >> shift) & 3 for shift in (0, 2, 4, 6)], axis=1)
    return ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)


def _q3_k(b: np.ndarray) -> BlockParts:  # high mask [0:32], 2-bit [32:96], scales [96:108], d [108:110]
    # The high bit of value 128n + 32j + i is bit 4n + j of mask byte i (i < 32): set means +4.
    high = _bits_of(b[:, 0:32], 256).reshape(-1, 32, 8).transpose(0, 2, 1).reshape(-1, QK_K)
    return BlockParts(_two_bit_quarters(b[:, 32:96]) | (high << np.uint8(2)), f16(b[:, 108:110]),
                      _q3_k_scales(b[:, 96:108]), None, None)


def _q2_k(b: np.ndarray) -> BlockParts:  # scales [0:16] (low: scale, high: min), 2-bit [16:80], d [80:82], dmin [82:84]
    steps = b[:, 0:16]
    return BlockParts(_two_bit_quarters(b[:, 16:80]), f16(b[:, 80:82]), (steps & 0xF).astype(np.int8),
                      f16(b[:, 82:84]), steps >> 4)


def _iq4_xs(b: np.ndarray) -> BlockParts:  # d [0:2], high scale bits [2:4], low scale nibbles [4:8], nibbles [8:136]
    high = b[:, 2:4].copy().view(np.dtype("<u2")).astype(np.uint16)
    low = np.concatenate([b[:, 4:8, None] & 0xF, b[:, 4:8, None] >> 4], axis=2).reshape(-1, 8)
    shifts = (np.arange(8, dtype=np.uint16) * 2).reshape(1, 8)
    steps = (low.astype(np.int16) | (((high >> shifts) & 3).astype(np.int16) << 4)) - 32
    return BlockParts(nibbles(b[:, 8:136].reshape(-1, 16)).reshape(-1, QK_K), f16(b[:, 0:2]), steps.astype(np.int8),
                      None, None)


BLOCK_FORMATS: dict[int, BlockFormat] = {f.type_id: f for f in (
    BlockFormat("Q4_0", 2, 32, 18, 4, 32, _q4_0, zero_point=8),
    BlockFormat("Q4_1", 3, 32, 20, 4, 32, _q4_1),
    BlockFormat("Q5_0", 6, 32, 22, 5, 32, _q5_0, zero_point=16),
    BlockFormat("Q5_1", 7, 32, 24, 5, 32, _q5_1),
    BlockFormat("Q8_0", 8, 32, 34, 8, 32, _q8_0, zero_point=128),
    BlockFormat("Q2_K", 10, QK_K, 84, 2, 16, _q2_k, subtracts_bias=True),
    BlockFormat("Q3_K", 11, QK_K, 110, 3, 16, _q3_k, zero_point=4),
    BlockFormat("Q4_K", 12, QK_K, 144, 4, 32, _q4_k, subtracts_bias=True),
    BlockFormat("Q5_K", 13, QK_K, 176, 5, 32, _q5_k, subtracts_bias=True),
    BlockFormat("Q6_K", 14, QK_K, 210, 6, 16, _q6_k, zero_point=32),
    BlockFormat("IQ4_NL", 20, 32, 18, 4, 32, _iq4_nl, codebook=IQ4_LEVELS),
    BlockFormat("IQ4_XS", 23, QK_K, 136, 4, 32, _iq4_xs, codebook=IQ4_LEVELS),
)}
