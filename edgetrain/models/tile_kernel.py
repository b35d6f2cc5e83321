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
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple

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
    if _tile_kernel.parallel():
        return "compiled tile kernel (one pass a row, the rows shared among torch's threads)"
    return "compiled tile kernel (one pass a row, one thread: built without OpenMP)"


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


class PackedParts(NamedTuple):
    """Rows of a packed matrix's tensors (None where its layout has none) and its codebook: what
    edgetrain.models.quantized.PackedMatrix holds, and what the kernel reads."""
    codes: torch.Tensor
    high_codes: torch.Tensor | None
    scales: torch.Tensor
    scale_steps: torch.Tensor | None
    biases: torch.Tensor | None
    bias_steps: torch.Tensor | None
    codebook: torch.Tensor | None

    def to(self, device: Any) -> "PackedParts":
        return PackedParts(*(None if t is None else t.to(device) for t in self))


@dataclass(frozen=True)
class KernelRows:
    """A packed matrix's tensors, checked once for the kernel (`plan`): `fill` dequantises any range of its
    rows, the kernel reading from that row's bytes on. A tile loop asks for one plan and fills each tile from
    it, so the checks and the slicing of six tensors are not paid a tile."""
    parts: PackedParts
    low_bits: int
    high_bits: int
    group_size: int
    offset: int
    subtracts_bias: bool

    @property
    def rows(self) -> int:
        return self.parts.codes.shape[0]

    @property
    def cols(self) -> int:
        return self.parts.codes.shape[1] * 8 // self.low_bits

    def fill_whole(self, out: torch.Tensor) -> bool:
        """Dequantise every row into `out` when it is a contiguous float32 CPU [rows, cols] tensor; else False,
        `out` untouched."""
        if not _plain(out, (torch.float32,), (self.rows, self.cols)):
            return False
        self.fill(out, 0, self.rows)
        return True

    def fill(self, out: torch.Tensor, start: int, stop: int) -> None:
        """Dequantise rows [start, stop) into `out`, a contiguous float32 CPU tensor of (stop - start) x cols
        entries (checked here: every other address was checked by `plan`)."""
        rows = stop - start
        if not (0 <= start <= stop <= self.rows and out.dtype == torch.float32 and out.device.type == "cpu"
                and out.is_contiguous() and out.numel() == rows * self.cols):
            raise ValueError(f"tile kernel: rows [{start}, {stop}) of a {self.rows}-row matrix do not fit an output "
                             f"of {out.numel()} {out.dtype} entries on {out.device}")
        if rows == 0:
            return
        groups, blocks = self.cols // self.group_size, self.parts.scales.shape[1]

        def at(tensor: torch.Tensor | None, row_entries: int) -> int:  # the address of row `start`'s first entry
            return 0 if tensor is None else tensor.data_ptr() + start * row_entries * tensor.element_size()

        parts = self.parts
        high_row = 0 if parts.high_codes is None else parts.high_codes.shape[1]
        _tile_kernel.dequantize_rows(out.data_ptr(), at(parts.codes, parts.codes.shape[1]), self.low_bits,
                                     at(parts.high_codes, high_row), self.high_bits, rows, self.cols, self.group_size,
                                     self.offset, at(parts.scales, blocks), int(parts.scales.dtype == torch.float16),
                                     groups // blocks, at(parts.scale_steps, groups), at(parts.biases, blocks),
                                     at(parts.bias_steps, groups), -1 if self.subtracts_bias else 1,
                                     0 if parts.codebook is None else parts.codebook.data_ptr(),
                                     torch.get_num_threads())


def plan(codes: torch.Tensor, low_bits: int, high_codes: torch.Tensor | None, high_bits: int, group_size: int,
         offset: int, scales: torch.Tensor, scale_steps: torch.Tensor | None, biases: torch.Tensor | None,
         bias_steps: torch.Tensor | None, subtracts_bias: bool, codebook: torch.Tensor | None) -> KernelRows | None:
    """The matrix's tensors as the kernel reads them (edgetrain/models/_tile_kernel.c has the arithmetic): the
    planes' codes, the stored scales and biases (float16 or float32, one a block) and the k-quants' int8 scale
    steps and uint8 bias steps (one a group); None when the kernel is off or cannot take these tensors as they
    are (another device or dtype, a strided view, a layout it does not know)."""
    if not available() or codes.dim() != 2 or low_bits not in _LOW_BITS or high_bits not in _HIGH_BITS:
        return None
    rows = codes.shape[0]
    cols = codes.shape[1] * 8 // low_bits
    if (group_size <= 0 or cols % group_size or (high_bits and cols % (8 // high_bits))
            or rows > _INT32_MAX or cols > _INT32_MAX or abs(offset) > 255):
        return None
    groups = cols // group_size
    if scales.dim() != 2 or scales.shape[1] <= 0 or groups % scales.shape[1]:
        return None
    blocks = scales.shape[1]
    if not (_plain(codes, (torch.uint8,), (rows, cols * low_bits // 8)) and _plain(scales, _STORED, (rows, blocks))):
        return None
    if high_bits and not _plain(high_codes, (torch.uint8,), (rows, cols * high_bits // 8)):
        return None
    # Steps are what let a block's one stored scale serve several groups; without them, one a group.
    stepped = scale_steps is not None
    if (blocks != groups and not stepped) or (stepped and not _plain(scale_steps, (torch.int8,), (rows, groups))):
        return None
    if biases is not None and not (_plain(biases, (scales.dtype,), (rows, blocks)) and (
            (bias_steps is None and not stepped) or (stepped and _plain(bias_steps, (torch.uint8,), (rows, groups))))):
        return None
    if biases is None and bias_steps is not None:
        return None
    if codebook is not None and (biases is not None or offset
                                 or not _plain(codebook, (torch.float32,), (2 ** (low_bits + high_bits),))):
        return None
    parts = PackedParts(codes, high_codes if high_bits else None, scales, scale_steps, biases,
                        bias_steps if biases is not None else None, codebook)
    return KernelRows(parts, low_bits, high_bits, group_size, offset, subtracts_bias)


def dequantize_rows(out: torch.Tensor, codes: torch.Tensor, low_bits: int, high_codes: torch.Tensor | None,
                    high_bits: int, group_size: int, offset: int, scales: torch.Tensor,
                    scale_steps: torch.Tensor | None, biases: torch.Tensor | None, bias_steps: torch.Tensor | None,
                    subtracts_bias: bool, codebook: torch.Tensor | None) -> bool:
    """Fill `out` [rows, cols] float32 from all the packed rows given (see `plan`). False, with `out` untouched,
    when the kernel is off or cannot take these tensors as they are."""
    rows_plan = plan(codes, low_bits, high_codes, high_bits, group_size, offset, scales, scale_steps, biases,
                     bias_steps, subtracts_bias, codebook)
    return rows_plan is not None and rows_plan.fill_whole(out)
