"""Frozen base weights kept in 4 or 8 bits on torch, dequantised one layer (or one tile of rows) at a time.

On a device the frozen weights are most of the footprint. A `PackedMatrix` holds a [rows, cols] matrix as
unsigned integers packed along each row (two 4-bit values a byte, or one 8-bit value), with a scale and a
bias per group of `group_size` columns: w = scale * q + bias, MLX's affine layout
(edgetrain.models.gguf.packed). GGUF's Q4_0, Q4_1 and Q8_0 blocks map onto it exactly (the symmetric Q4_0
and Q8_0 with a zero point, w = scale * (q - zero_point), and no stored bias), so a GGUF model loads
without requantising (`load_model(path.gguf, quantized=True)`); dense weights are quantised on load per
group from their minimum and maximum (`load_model(..., quantize_bits=4)`, edgetrain.models.quantize).

Three modules use one: `QuantizedLinear` (a block projection, or an untied LM head), `QuantizedEmbedding`
(the token table: a lookup dequantises only the rows it reads) and `TiedQuantizedHead` (an LM head that
reads the embedding's packed table, as a tied nn.Linear shares the embedding's weight).

Scales and biases are stored in float16: a GGUF's are float16 in the file, and a quantised-on-load group's
are rounded to float16 before its integers are chosen (float32 where float16 cannot hold them). A dtype
cast of the model (`.double()`, `.to(torch.bfloat16)`) moves them between devices but never rounds them;
it sets the dtype the layer computes and returns in (`.dtype`). Dequantisation runs in float32 (float64
for a float64 model), so a GGUF's weights come out exactly as ggml computes them.

The dense weight exists only while one layer computes with it: the forward dequantises, multiplies and
drops it; the backward (the weight is frozen, so only dL/dx = dL/dy W is needed) dequantises it again
rather than keeping it from the forward. A matrix is dequantised in tiles of rows into a reused scratch
buffer (tile_elements: small on a CPU, for its cache; larger on a GPU, for fewer kernel launches). `mesp`
takes the same tiles (PackedMatrix.scratch_tiles) in its forward, recompute and backward, and reads the head a
vocabulary tile at a time. On a CPU a float32 tile is dequantised by a compiled kernel in one pass over each
row (edgetrain.models.tile_kernel, built at install), else by torch kernels a plane and a scaling at a time:
the same numbers either way.
Gradients equal autograd through the dequantised weights (tests/models/test_quantized.py).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np
import torch
from torch import nn

from edgetrain.models import tile_kernel
from edgetrain.registry import EdgetrainError

GROUP_SIZE = 32
SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)  # what a packed matrix holds (GGUF's formats)
QUANTIZE_BITS = (4, 8)  # what fill_from_dense makes (quantise-on-load)
STORAGE_DTYPE = torch.float16
# Computing layers dequantise a tile of rows of at most this many entries at a time (1 MiB of float32:
# a Qwen2.5-0.5B MLP matrix in 17 tiles, no slower than whole), into a scratch buffer kept per thread,
# device and dtype. Reusing it matters: a fresh buffer per tile is fresh pages per tile (glibc maps large
# blocks anew when the probes pin its mmap threshold), and faulting them in cost more than dequantising.
TILE_ELEMENTS = 1 << 18
# On a GPU the kernel launches, not the cache, set the cost: a 1 MiB tile is a few microseconds of work
# behind about ten launches, so tiles there are 16x larger (16 MiB of float32).
ACCELERATOR_TILE_ELEMENTS = 1 << 22
# With the compiled tile kernel (edgetrain.models.tile_kernel) a tile costs a fifth of the torch kernels'
# passes, and the work around each tile (slicing its rows, a product launch) is what is left: tiles twice as
# large (2 MiB of float32, a core's L2 here) made a SmolLM2 mesp step 11% faster, larger ones no faster
# (one thread, in-process A/B, 2026-12-07).
KERNEL_TILE_ELEMENTS = 1 << 19
_SCRATCH = threading.local()


def tile_elements(device: torch.device | str) -> int:
    """Entries in one dequantised tile on `device`: on a CPU TILE_ELEMENTS, or KERNEL_TILE_ELEMENTS where the
    compiled tile kernel runs; ACCELERATOR_TILE_ELEMENTS elsewhere."""
    if torch.device(device).type != "cpu":
        return ACCELERATOR_TILE_ELEMENTS
    return KERNEL_TILE_ELEMENTS if tile_kernel.available() else TILE_ELEMENTS


def _scratch(kind: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable flat buffer of `numel` entries for this thread (and CUDA stream): valid until the next
    request of the same kind, dtype and device on it."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})
    key = (kind, dtype, device, stream)
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffers[key] = buffer = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel]


def _under_functorch() -> bool:
    """Whether a torch.func transform (jvp, vmap, grad) is running: it forbids writing into a tensor made
    outside it, so the scratch buffers are not used there."""
    peek = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


@dataclass(frozen=True)
class MatrixLayout:
    """How a PackedMatrix's integers become weights, in groups of `group_size` columns of a row:

        zero point   w = (c - zero_point) * scale        (a symmetric format: no biases stored)
        codebook     w = codebook[c] * scale             (IQ4_NL, IQ4_XS: a non-uniform grid)
        otherwise    w = c * scale + bias                (or - bias: subtracts_bias, the k-quants' minimum)

    With `steps`, a group's scale (and bias) is one stored float16 per `block_values` columns times the
    group's own small integer (the k-quants' sub-block scales); without, one stored value per group.
    Codes of `bits` bits are a low plane of 2, 4 or 8 bits a value and, for 3, 5 and 6 bits, a high plane
    (edgetrain.models.gguf.packed_rows has the layout)."""
    bits: int
    group_size: int = GROUP_SIZE
    zero_point: int | None = None
    block_values: int | None = None  # columns per stored scale when `steps`; else group_size
    steps: bool = False
    subtracts_bias: bool = False
    codebook: tuple[int, ...] | None = None
    format_name: str | None = field(default=None, compare=False)  # the GGUF type it came from, for messages

    @property
    def has_bias(self) -> bool:
        return self.zero_point is None and self.codebook is None

    @property
    def planes(self) -> tuple[int, int]:
        """(low plane bits, high plane bits; 0 when none)."""
        low = {2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 8: 8}[self.bits]
        return low, self.bits - low

    @property
    def scale_columns(self) -> int:
        """Columns that share one stored scale."""
        return self.block_values if self.steps else self.group_size

    def check(self, cols: int) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise EdgetrainError(f"quantised weights take {', '.join(map(str, SUPPORTED_BITS))} bits, not {self.bits!r}")
        low_bits, high_bits = self.planes
        per_byte = 8 // min(low_bits, high_bits or 8)  # a plane's columns per byte: rows fill whole bytes
        if (self.group_size <= 0 or cols % self.group_size or cols % per_byte
                or (self.steps and (not self.block_values or self.block_values % self.group_size
                                    or cols % self.block_values))):
            raise EdgetrainError(f"a layer of {cols} inputs cannot be cut into groups of {self.group_size}")
        _check_zero_point(self.zero_point, self.bits)
        if self.codebook is not None and len(self.codebook) != 2 ** self.bits:
            raise EdgetrainError(f"a {self.bits}-bit codebook holds {2 ** self.bits} levels, not {len(self.codebook)}")


class PackedMatrix(nn.Module):
    """A frozen [rows, cols] matrix held packed (see the module docstring and MatrixLayout). Its tensors
    are buffers: nothing here trains."""

    def __init__(self, rows: int, cols: int, bits: int, group_size: int = GROUP_SIZE, device: Any = None,
                 dtype: torch.dtype = torch.float32, storage_dtype: torch.dtype = STORAGE_DTYPE,
                 zero_point: int | None = None, layout: MatrixLayout | None = None) -> None:
        super().__init__()
        layout = layout or MatrixLayout(bits, group_size, zero_point)
        if layout.bits != bits or layout.group_size != group_size:
            raise EdgetrainError(f"layout of {layout.bits} bits in groups of {layout.group_size} given for a "
                                 f"{bits}-bit matrix in groups of {group_size}")
        layout.check(cols)
        self.rows, self.cols, self.bits, self.group_size = rows, cols, bits, group_size
        self.layout = layout
        groups, stored = cols // group_size, cols // layout.scale_columns
        low_bits, high_bits = layout.planes
        self.register_buffer("codes", torch.zeros(rows, cols * low_bits // 8, dtype=torch.uint8, device=device))
        self.register_buffer("high_codes", torch.zeros(rows, cols * high_bits // 8, dtype=torch.uint8, device=device)
                             if high_bits else None)
        self.register_buffer("scales", torch.zeros(rows, stored, dtype=storage_dtype, device=device))
        self.register_buffer("scale_steps", torch.zeros(rows, groups, dtype=torch.int8, device=device)
                             if layout.steps else None)
        # A symmetric format (GGUF Q4_0, Q8_0, Q6_K) has w = scale * (q - zero_point): its bias is
        # -zero_point * scale in every group, so it is computed, not stored (an eighth of Q8_0's bytes).
        self.register_buffer("biases", torch.zeros(rows, stored, dtype=storage_dtype, device=device)
                             if layout.has_bias else None)
        self.register_buffer("bias_steps", torch.zeros(rows, groups, dtype=torch.uint8, device=device)
                             if layout.has_bias and layout.steps else None)
        self.register_buffer("codebook", None if layout.codebook is None else
                             torch.tensor(layout.codebook, dtype=torch.float32, device=device))
        # Empty: it carries the dtype the layer computes in through .to() / .double() like any float tensor.
        self.register_buffer("_dtype_marker", torch.empty(0, dtype=dtype, device=device), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype this layer computes in and returns (the model's), not the packed storage's."""
        return self._dtype_marker.dtype

    @property
    def zero_point(self) -> int | None:
        return self.layout.zero_point

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "PackedMatrix":
        # A model-wide dtype cast must not round the stored scales (float16 -> bfloat16 loses bits): keep
        # their dtype, follow only the device. The marker takes the new dtype.
        stored = {name: getattr(self, name) for name in ("scales", "biases", "codebook")
                  if getattr(self, name) is not None}
        super()._apply(fn, recurse)
        for name, original in stored.items():
            applied = getattr(self, name)
            if applied.dtype != original.dtype:
                setattr(self, name, original.to(applied.device))
        return self

    def _work_dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        wanted = self.dtype if dtype is None else dtype
        return torch.float64 if torch.float64 in (wanted, self.scales.dtype) else torch.float32

    def _dequantize_packed(self, parts: "_Rows", dtype: torch.dtype | None, scratch: bool = False) -> torch.Tensor:
        """Dense rows from packed ones: one buffer (a scratch one when asked), filled with the integers and
        scaled in place."""
        work = self._work_dtype(dtype)
        wanted = self.dtype if dtype is None else dtype
        codes = parts.codes
        rows, device = codes.shape[0], codes.device
        scratch = scratch and not _under_functorch()
        if scratch and wanted == work:
            dense = _scratch("dense", rows * self.cols, work, device).view(rows, self.cols)
        else:
            dense = torch.empty(rows, self.cols, dtype=work, device=device)
        layout = self.layout
        low_bits, high_bits = layout.planes
        if work == torch.float32 and self._dequantize_compiled(parts, dense):
            return dense if wanted == work else dense.to(wanted)
        # Codes a plane at a time, straight into the floats: the high plane's contributions, with the zero
        # point folded in (small integers: exact), come from a 256-entry table (_plane_table), one gather.
        shifted = layout.zero_point is not None and high_bits > 0
        if layout.codebook is not None:
            integers = self._unpack_codes(parts, scratch)
            torch.index_select(parts.codebook.to(work), 0, integers.view(-1).to(torch.int32), out=dense.view(-1))
        else:
            if low_bits == 4:  # byte i holds columns 2i (low nibble) and 2i + 1 (high nibble)
                pairs = dense.view(rows, self.cols // 2, 2)
                nibbles = (_scratch("nibbles", codes.numel(), torch.uint8, device).view(codes.shape) if scratch
                           else torch.empty_like(codes))
                pairs[..., 0].copy_(torch.bitwise_and(codes, 0x0F, out=nibbles))
                pairs[..., 1].copy_(torch.bitwise_right_shift(codes, 4, out=nibbles))
            elif low_bits == 8:
                dense.copy_(codes)
            else:
                _gather_plane(codes, low_bits, 0, 0, dense, scratch)
            if high_bits:
                high = (_scratch("high", rows * self.cols, work, device) if scratch
                        else torch.empty(rows, self.cols, dtype=work, device=device)).view(rows, self.cols)
                _gather_plane(parts.high_codes, high_bits, low_bits, -(layout.zero_point or 0), high, scratch)
                dense.add_(high)
        grouped = dense.view(rows, -1, self.group_size)
        scales = self._group_values(parts.scales, parts.scale_steps, work)
        # Mixed dtypes in place: float16 scales convert inside the kernel (exactly), no launch of their own.
        if not layout.has_bias:
            # Exactly (q - zero_point) * scale: q - zero_point is a small integer, and a float16 scale (or
            # an f16 times an integer step) times it rounds once, as ggml's product does.
            if layout.zero_point is not None and not shifted:
                grouped.sub_(layout.zero_point)
            grouped.mul_(scales.unsqueeze(-1))
        else:
            biases = self._group_values(parts.biases, parts.bias_steps, work)
            if layout.subtracts_bias:
                grouped.mul_(scales.unsqueeze(-1)).sub_(biases.unsqueeze(-1))
            else:
                grouped.mul_(scales.unsqueeze(-1)).add_(biases.unsqueeze(-1))
        return dense if wanted == work else dense.to(wanted)

    def _dequantize_compiled(self, parts: "_Rows", dense: torch.Tensor) -> bool:
        """Fill float32 `dense` in one pass of the compiled tile kernel (edgetrain.models.tile_kernel), in the
        torch path's arithmetic; False where the kernel is not built or cannot take these rows."""
        rows = self._kernel_plan(parts)
        return rows is not None and rows.fill_whole(dense)

    def _kernel_plan(self, parts: "_Rows") -> "tile_kernel.KernelRows | None":
        """These packed rows with this matrix's layout as the compiled tile kernel reads them, or None where it
        is off or cannot take them (tile_kernel.plan)."""
        layout = self.layout
        low_bits, high_bits = layout.planes
        codebook = None if parts.codebook is None else parts.codebook.to(torch.float32)
        return tile_kernel.plan(parts.codes, low_bits, parts.high_codes, high_bits, layout.group_size,
                                -(layout.zero_point or 0), parts.scales, parts.scale_steps, parts.biases,
                                parts.bias_steps, layout.subtracts_bias, codebook)

    def _group_values(self, stored: torch.Tensor, steps: torch.Tensor | None, work: torch.dtype) -> torch.Tensor:
        """One scale (or bias) a group: the stored values, or, with steps, each block's stored value times its
        groups' integer steps (exact: an f16 times an integer of at most 8 bits)."""
        if steps is None:
            return stored
        per_block = self.layout.block_values // self.group_size
        return stored.to(work).repeat_interleave(per_block, dim=1).mul_(steps)

    def _unpack_codes(self, parts: "_Rows", scratch: bool) -> torch.Tensor:
        """uint8 [rows, cols]: each column's code, from the low plane and the high plane above it."""
        rows, device = parts.codes.shape[0], parts.codes.device
        low_bits, high_bits = self.layout.planes
        integers = (_scratch("codes", rows * self.cols, torch.uint8, device) if scratch
                    else torch.empty(rows * self.cols, dtype=torch.uint8, device=device)).view(rows, self.cols)
        _unpack_plane(parts.codes, low_bits, integers)
        if high_bits:
            high = (_scratch("high", rows * self.cols, torch.uint8, device) if scratch
                    else torch.empty(rows * self.cols, dtype=torch.uint8, device=device)).view(rows, self.cols)
            _unpack_plane(parts.high_codes, high_bits, high)
            integers.bitwise_or_(high.bitwise_left_shift_(low_bits))
        return integers

    def scratch_tiles(self, dtype: torch.dtype | None = None, device: Any = None,
                      rows_per_tile: int | None = None) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(start, stop, dense rows [start, stop)) covering the matrix, `rows_per_tile` rows at a time (as
        many as tile_elements(device) entries hold by default). Each tile lives in a scratch buffer that the
        next tile overwrites: use it before asking for the next."""
        step = rows_per_tile or max(1, tile_elements(self.device if device is None else device) // self.cols)
        kernel_rows = self._kernel_rows(dtype, device)
        for start in range(0, self.rows, step):
            stop = min(start + step, self.rows)
            if kernel_rows is None:
                yield start, stop, self.dequantize_rows(start, stop, dtype, device, scratch=True)
                continue
            # The compiled kernel straight from the matrix's own tensors: checked once above, not a tile.
            rows = stop - start
            tile = _scratch("dense", rows * self.cols, torch.float32, self.device).view(rows, self.cols)
            kernel_rows.fill(tile, start, stop)
            yield start, stop, tile

    def _kernel_rows(self, dtype: torch.dtype | None, device: Any) -> "tile_kernel.KernelRows | None":
        """This matrix as the compiled tile kernel reads it, where its tiles are float32 scratch tiles on the CPU
        it lives on; else None (the general path: _dequantize_packed)."""
        if (self.device.type != "cpu" or (device is not None and torch.device(device) != self.device)
                or self._work_dtype(dtype) != torch.float32 or (self.dtype if dtype is None else dtype) != torch.float32
                or _under_functorch()):
            return None
        return self._kernel_plan(self._packed_rows(slice(None)))

    def dequantize(self, dtype: torch.dtype | None = None, device: Any = None) -> torch.Tensor:
        """The whole dense [rows, cols] matrix in `dtype` (the layer's by default)."""
        return self.dequantize_rows(0, self.rows, dtype, device)

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype | None = None,
                        device: Any = None, scratch: bool = False) -> torch.Tensor:
        """Dense rows [start, stop); in this thread's scratch buffer with `scratch` (see scratch_tiles)."""
        parts = self._packed_rows(slice(start, stop))
        return self._dequantize_packed(parts if device is None else parts.to(device), dtype, scratch)

    def _packed_rows(self, index: slice | torch.Tensor) -> "_Rows":
        """The packed tensors of the rows `index` selects (None where the layout has none)."""
        return _Rows(*(None if t is None else t[index] for t in
                       (self.codes, self.high_codes, self.scales, self.scale_steps, self.biases, self.bias_steps)),
                     self.codebook)

    def unpacked_codes(self) -> torch.Tensor:
        """uint8 [rows, cols]: every column's code, its planes put together (an export's wide layout)."""
        return self._unpack_codes(self._packed_rows(slice(0, self.rows)), scratch=False)

    def dequantize_gathered(self, indices: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dense rows `indices` (any shape of integers): [*indices.shape, cols]."""
        flat = indices.reshape(-1)
        dense = self._dequantize_packed(self._packed_rows(flat), dtype)
        return dense.view(*indices.shape, self.cols)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised matrix, for code that reads a weight (an export, an estimate): built on each read."""
        return self.dequantize()

    def packed_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.high_codes, self.scales, self.scale_steps,
                                                          self.biases, self.bias_steps) if t is not None)

    def fill_from_dense(self, weight: torch.Tensor) -> None:
        """Quantise a dense [rows, cols] weight into this matrix per group: bias = the group's minimum,
        scale = its range / (2**bits - 1), both rounded to the storage dtype first, then
        q = round((w - bias) / scale). Every weight is then within half a step (plus the rounding of the
        minimum) of its value; a constant group is exact when its value is a float16."""
        if tuple(weight.shape) != (self.rows, self.cols):
            raise EdgetrainError(f"cannot quantise a {tuple(weight.shape)} weight into a ({self.rows}, {self.cols}) "
                                 "packed matrix")
        if not torch.isfinite(weight).all():
            raise EdgetrainError("cannot quantise a weight that holds NaN or infinite values")
        if self.bits not in QUANTIZE_BITS:
            raise EdgetrainError(f"quantised weights take {' or '.join(map(str, QUANTIZE_BITS))} bits, not {self.bits!r}")
        levels = 2 ** self.bits - 1
        work = weight.detach().to(torch.float32).reshape(self.rows, -1, self.group_size)
        low = work.amin(dim=-1)
        scale = (work.amax(dim=-1) - low) / levels
        storage = STORAGE_DTYPE
        if not (torch.isfinite(low.to(storage)).all() and torch.isfinite(scale.to(storage)).all()):
            storage = torch.float32  # beyond float16's range
        low, scale = low.to(storage).to(torch.float32), scale.to(storage).to(torch.float32)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round((work - low.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, levels).to(torch.uint8)
        q = q.reshape(self.rows, self.cols)
        self.codes = (q[:, 0::2] | (q[:, 1::2] << 4) if self.bits == 4 else q).contiguous()
        self.scales, self.biases = scale.to(storage), low.to(storage)
        self.high_codes = self.scale_steps = self.bias_steps = self.codebook = None
        self.layout = MatrixLayout(self.bits, self.group_size)

    def fill_from_rows(self, packed: Any) -> None:
        """From an edgetrain.models.gguf.packed_rows.PackedRows of this matrix's layout (GGUF blocks, moved,
        not requantised: the file's f16 scales and integer steps as they are)."""
        if tuple(packed.codes.shape) != tuple(self.codes.shape) or layout_of(packed.format) != self.layout:
            raise EdgetrainError(f"packed {packed.format.name} rows of {packed.codes.shape} code bytes do not fit a "
                                 f"{tuple(self.codes.shape)}, {self.bits}-bit matrix")
        for name in ("codes", "high_codes", "scales", "scale_steps", "biases", "bias_steps"):
            array = getattr(packed, name)
            setattr(self, name, None if array is None else torch.from_numpy(array))  # shares: no second copy
        if self.layout.codebook is not None:  # a shell built on the meta device holds an empty one
            self.codebook = torch.tensor(self.layout.codebook, dtype=torch.float32)


def layout_of(block_format: Any) -> MatrixLayout:
    """The MatrixLayout that holds a ggml block format (edgetrain.models.gguf.blocks.BlockFormat) as it is."""
    steps = block_format.block_values != block_format.group_size
    return MatrixLayout(block_format.bits, block_format.group_size, block_format.zero_point,
                        block_format.block_values if steps else None, steps, block_format.subtracts_bias,
                        None if block_format.codebook is None else tuple(int(v) for v in block_format.codebook),
                        block_format.name)


def _check_zero_point(zero_point: int | None, bits: int) -> int | None:
    if zero_point is not None and (isinstance(zero_point, bool) or not isinstance(zero_point, int)
                                   or not 0 <= zero_point < 2 ** bits):
        raise EdgetrainError(f"a {bits}-bit zero point must be an integer in [0, {2 ** bits}), not {zero_point!r}")
    return zero_point


# Some rows of a PackedMatrix's tensors and its codebook, as the tile kernel reads them too.
_Rows = tile_kernel.PackedParts


def _unpack_plane(plane: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """[rows, cols * bits / 8] bytes -> out uint8 [rows, cols]: column (8 / bits) i + t is in bits
    [bits t, bits (t + 1)) of byte i."""
    if bits == 8:
        out.copy_(plane)
        return
    per_byte = 8 // bits
    slots = out.view(out.shape[0], -1, per_byte)
    mask = (1 << bits) - 1
    for t in range(per_byte):
        shifted = plane if t == 0 else torch.bitwise_right_shift(plane, bits * t)
        torch.bitwise_and(shifted, mask, out=slots[..., t])


_PLANE_TABLES: dict[tuple, torch.Tensor] = {}


def _plane_table(bits: int, shift: int, offset: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8 / bits]: for each byte of a `bits`-bit plane, its values shifted left by `shift`, plus `offset`."""
    key = (bits, shift, offset, dtype, device)
    table = _PLANE_TABLES.get(key)
    if table is None:
        per_byte, mask = 8 // bits, (1 << bits) - 1
        values = [[((byte >> (bits * t)) & mask) * (1 << shift) + offset for t in range(per_byte)] for byte in range(256)]
        table = _PLANE_TABLES[key] = torch.tensor(values, dtype=dtype, device=device)
    return table


def _gather_plane(plane: torch.Tensor, bits: int, shift: int, offset: int, out: torch.Tensor, scratch: bool) -> None:
    """out [rows, cols] = each column's value in a `bits`-bit plane, shifted left by `shift`, plus `offset`:
    one gather from _plane_table (a row of it a byte), where shifting and masking would be 8 / bits passes."""
    index = plane.reshape(-1)
    index = (_scratch("plane_index", index.numel(), torch.int32, plane.device) if scratch and not _under_functorch()
             else torch.empty(index.numel(), dtype=torch.int32, device=plane.device)).copy_(index)
    table = _plane_table(bits, shift, offset, out.dtype, out.device)
    torch.index_select(table, 0, index, out=out.view(-1, table.shape[1]))


class QuantizedMatmul(torch.autograd.Function):
    """x W^T with W dequantised from `matrix` a tile of rows at a time in the forward and again in the
    backward (never saved)."""

    @staticmethod
    def forward(x: torch.Tensor, matrix: PackedMatrix) -> torch.Tensor:
        return _times_transposed(x, matrix)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.matrix = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        matrix: PackedMatrix = ctx.matrix
        flat = grad_output.reshape(-1, matrix.rows)
        grad_x = flat.new_zeros(flat.shape[0], matrix.cols)
        for start, stop, tile in matrix.scratch_tiles(grad_output.dtype, grad_output.device):
            grad_x.addmm_(flat[:, start:stop], tile)
        return grad_x.view(*grad_output.shape[:-1], matrix.cols), None

    @staticmethod
    def jvp(ctx: Any, x_tangent: torch.Tensor, _: Any) -> torch.Tensor:
        return _times_transposed(x_tangent, ctx.matrix)


def _times_transposed(x: torch.Tensor, matrix: PackedMatrix) -> torch.Tensor:
    flat = x.reshape(-1, matrix.cols)
    out = flat.new_empty(flat.shape[0], matrix.rows)
    for start, stop, tile in matrix.scratch_tiles(x.dtype, x.device):
        torch.mm(flat, tile.t(), out=out[:, start:stop])
    return out.view(*x.shape[:-1], matrix.rows)


class QuantizedLinear(PackedMatrix):
    """A frozen y = x W^T (+ b) whose W [out_features, in_features] is held packed."""

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int = GROUP_SIZE,
                 bias: bool = False, device: Any = None, dtype: torch.dtype = torch.float32,
                 storage_dtype: torch.dtype = STORAGE_DTYPE, zero_point: int | None = None,
                 layout: MatrixLayout | None = None) -> None:
        super().__init__(out_features, in_features, bits, group_size, device, dtype, storage_dtype, zero_point, layout)
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, bias={self.bias is not None}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = QuantizedMatmul.apply(x, self)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @classmethod
    def from_rows(cls, packed: Any, bias: torch.Tensor | None = None,
                  dtype: torch.dtype = torch.float32) -> "QuantizedLinear":
        """From an edgetrain.models.gguf.packed_rows.PackedRows (GGUF blocks, moved, not requantised)."""
        rows, cols = packed.shape
        layout = layout_of(packed.format)
        # Built on the meta device: its zero buffers would be a full-size allocation for nothing.
        layer = cls(cols, rows, layout.bits, layout.group_size, bias is not None, device="meta", dtype=dtype,
                    layout=layout)
        layer.fill_from_rows(packed)
        layer._dtype_marker = torch.empty(0, dtype=dtype)
        if bias is not None:
            layer.bias = bias.detach().to(dtype).clone()
        return layer

    @classmethod
    def from_dense(cls, weight: torch.Tensor, bits: int, bias: torch.Tensor | None = None,
                   group_size: int = GROUP_SIZE) -> "QuantizedLinear":
        """Quantise a dense [out, in] weight per group of `group_size` inputs (PackedMatrix.fill_from_dense)."""
        out_features, in_features = weight.shape
        dtype = weight.dtype if weight.is_floating_point() else torch.float32
        layer = cls(in_features, out_features, bits, group_size, bias is not None, device=weight.device, dtype=dtype)
        layer.fill_from_dense(weight)
        if bias is not None:
            layer.bias = bias.detach().clone()
        return layer


class QuantizedEmbedding(PackedMatrix):
    """A frozen token table [num_embeddings, embedding_dim] held packed; a lookup dequantises only the
    rows it reads."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bits: int, group_size: int = GROUP_SIZE,
                 device: Any = None, dtype: torch.dtype = torch.float32,
                 storage_dtype: torch.dtype = STORAGE_DTYPE, zero_point: int | None = None,
                 layout: MatrixLayout | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, bits, group_size, device, dtype, storage_dtype, zero_point,
                         layout)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, bits={self.bits}, group_size={self.group_size}"

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if token_ids.dtype not in (torch.int32, torch.int64):
            raise EdgetrainError(f"token ids must be integers, not {token_ids.dtype}")
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= self.num_embeddings):
            raise EdgetrainError(f"token ids must lie in [0, {self.num_embeddings}); got "
                                 f"[{int(token_ids.min())}, {int(token_ids.max())}]")
        return self.dequantize_gathered(token_ids)

    @classmethod
    def from_rows(cls, packed: Any, dtype: torch.dtype = torch.float32) -> "QuantizedEmbedding":
        """From an edgetrain.models.gguf.packed_rows.PackedRows (GGUF blocks, moved, not requantised)."""
        rows, cols = packed.shape
        layout = layout_of(packed.format)
        table = cls(rows, cols, layout.bits, layout.group_size, device="meta", dtype=dtype, layout=layout)
        table.fill_from_rows(packed)
        table._dtype_marker = torch.empty(0, dtype=dtype)
        return table

    @classmethod
    def from_dense(cls, weight: torch.Tensor, bits: int, group_size: int = GROUP_SIZE) -> "QuantizedEmbedding":
        rows, cols = weight.shape
        dtype = weight.dtype if weight.is_floating_point() else torch.float32
        table = cls(rows, cols, bits, group_size, device=weight.device, dtype=dtype)
        table.fill_from_dense(weight)
        return table


class TiedQuantizedHead(nn.Module):
    """An LM head y = x E^T over a QuantizedEmbedding's packed table E (tied word embeddings). The table is
    referenced, not registered: it is stored, moved and cast once, as the embedding's, and a deepcopy of
    the model keeps the two tied."""

    def __init__(self, embedding: QuantizedEmbedding) -> None:
        super().__init__()
        self.__dict__["table"] = embedding  # not a submodule: see the class docstring
        self.in_features, self.out_features = embedding.embedding_dim, embedding.num_embeddings
        self.bias = None

    @property
    def dtype(self) -> torch.dtype:
        return self.table.dtype

    @property
    def weight(self) -> torch.Tensor:
        return self.table.dequantize()

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype | None = None,
                        device: Any = None, scratch: bool = False) -> torch.Tensor:
        return self.table.dequantize_rows(start, stop, dtype, device, scratch)

    def dequantize_gathered(self, indices: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.table.dequantize_gathered(indices, dtype)

    def extra_repr(self) -> str:
        return f"tied to the {self.out_features}-row quantised embedding"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return QuantizedMatmul.apply(x, self.table)


QUANTIZED_HEADS = (QuantizedLinear, TiedQuantizedHead)


def is_quantized(module: nn.Module) -> bool:
    """Whether any layer of `module` holds quantised weights."""
    return any(isinstance(m, PackedMatrix) for m in module.modules())


def packed_matrix_count(model: nn.Module) -> int:
    """How many of the model's matrices are held packed (a tied head reads the embedding's: not counted)."""
    return sum(isinstance(module, PackedMatrix) for module in model.modules())
