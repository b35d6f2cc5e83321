"""Dequantising a packed matrix's rows in one compiled pass, on a CPU in float32.

edgetrain.models.quantized dequantises a tile of rows with torch kernels: the codes' planes, a conversion to
float, the scales, the biases, a pass over the tile each. On a CPU those passes took about as long as the
matrix product the tile feeds (docs/gguf.md). `_tile_kernel` (edgetrain/models/_tile_kernel.c, built when
edgetrain is installed) does it in one pass over each row, in the same float32 arithmetic, bit for bit
(tests/models/test_tile_kernel.py).

The kernel is optional: where it was not built (no C compiler at install time) or cannot take the tensors
(another device, float64, a layout it does not know), `dequantize_rows` returns False and the torch path
runs, with the same numbers. `EDGETRAIN_TILE_KERNEL=off` turns it off for a process (the benchmarks' torch
arm); `kernel_enabled(False)` for a block of code.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

try:
    from edgetrain.models import _tile_kernel
except ImportError:  # built at install time; without a C compiler the torch path runs
    _tile_kernel = None

ENVIRONMENT_SWITCH = "EDGETRAIN_TILE_KERNEL"
_enabled = os.environ.get(ENVIRONMENT_SWITCH, "on").strip().lower() not in ("off", "0", "false", "no")

# What the kernel reads: low planes of 2, 4 or 8 bits, high planes of 1 or 2 bits (or none).
_LOW_BITS, _HIGH_BITS = (2, 4, 8), (0, 1, 2)
_INT32_MAX = 2**31 - 1


def available() -> bool:
    """Whether the compiled kernel is built and not turned off."""
    return _tile_kernel is not None and _enabled


def status() -> str:
    """One line for `edgetrain list` and the profile: which dequantisation a CPU tile takes, and why."""
    if _tile_kernel is None:
        return ("torch kernels (the compiled tile kernel was not built: reinstall edgetrain where a C compiler "
                "is found)")
    if not _enabled:
        return f"torch kernels ({ENVIRONMENT_SWITCH}=off)"
    return "compiled tile kernel (one pass a row)"


@contextlib.contextmanager
def kernel_enabled(enabled: bool) -> Iterator[None]:
    """Turn the kernel on or off inside a block (it is on by default when built)."""
    global _enabled
    before, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = before


def _plain(tensor: torch.Tensor | None, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...]) -> bool:
    return (tensor is not None and tensor.device.type == "cpu" and tensor.dtype in dtypes
            and tuple(tensor.shape) == shape and tensor.is_contiguous())


_STORED = (torch.float16, torch.float32)


def dequantize_rows(out: torch.Tensor, codes: torch.Tensor, low_bits: int, high_codes: torch.Tensor | None,
                    high_bits: int, group_size: int, offset: int, scales: torch.Tensor,
                    scale_steps: torch.Tensor | None, biases: torch.Tensor | None, bias_steps: torch.Tensor | None,
                    subtracts_bias: bool, codebook: torch.Tensor | None) -> bool:
    """Fill `out` [rows, cols] float32 from packed rows as PackedMatrix holds them (edgetrain/models/_tile_kernel.c
    has the arithmetic): the planes' codes, the stored scales and biases (float16 or float32, one a block) and
    the k-quants' int8 scale steps and uint8 bias steps (one a group). False, with `out` untouched, when the
    kernel is off or cannot take these tensors as they are."""
    if not available() or out.dim() != 2 or low_bits not in _LOW_BITS or high_bits not in _HIGH_BITS:
        return False
    rows, cols = out.shape
    if (group_size <= 0 or cols % group_size or cols % (8 // low_bits) or (high_bits and cols % (8 // high_bits))
            or rows > _INT32_MAX or cols > _INT32_MAX or abs(offset) > 255):
        return False
    groups = cols // group_size
    if scales.dim() != 2 or scales.shape[1] <= 0 or groups % scales.shape[1]:
        return False
    blocks = scales.shape[1]
    if not (_plain(out, (torch.float32,), (rows, cols)) and _plain(codes, (torch.uint8,), (rows, cols * low_bits // 8))
            and _plain(scales, _STORED, (rows, blocks))):
        return False
    if high_bits and not _plain(high_codes, (torch.uint8,), (rows, cols * high_bits // 8)):
        return False
    # Steps are what let a block's one stored scale serve several groups; without them, one a group.
    stepped = scale_steps is not None
    if (blocks != groups and not stepped) or (stepped and not _plain(scale_steps, (torch.int8,), (rows, groups))):
        return False
    if biases is not None and not (_plain(biases, (scales.dtype,), (rows, blocks)) and (
            (bias_steps is None and not stepped) or (stepped and _plain(bias_steps, (torch.uint8,), (rows, groups))))):
        return False
    if biases is None and bias_steps is not None:
        return False
    if codebook is not None and (biases is not None or offset
                                 or not _plain(codebook, (torch.float32,), (2 ** (low_bits + high_bits),))):
        return False
    if rows == 0:
        return True
    _tile_kernel.dequantize_rows(out.data_ptr(), codes.data_ptr(), low_bits,
                                 high_codes.data_ptr() if high_bits else 0, high_bits, rows, cols, group_size, offset,
                                 scales.data_ptr(), int(scales.dtype == torch.float16), groups // blocks,
                                 scale_steps.data_ptr() if stepped else 0,
                                 0 if biases is None else biases.data_ptr(),
                                 0 if bias_steps is None else bias_steps.data_ptr(), -1 if subtracts_bias else 1,
                                 0 if codebook is None else codebook.data_ptr())
    return True
