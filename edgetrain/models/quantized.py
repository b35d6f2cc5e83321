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
buffer (tile_elements: small on a CPU, for its cache; larger on a GPU, for fewer kernel launches). `mesp` takes the same tiles (PackedMatrix.scratch_tiles) in its forward, recompute
and backward, and reads the head a vocabulary tile at a time.
Gradients equal autograd through the dequantised weights (tests/models/test_quantized.py).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn

from edgetrain.registry import EdgetrainError

GROUP_SIZE = 32
SUPPORTED_BITS = (4, 8)
STORAGE_DTYPE = torch.float16
# Computing layers dequantise a tile of rows of at most this many entries at a time (1 MiB of float32:
# a Qwen2.5-0.5B MLP matrix in 17 tiles, no slower than whole), into a scratch buffer kept per thread,
# device and dtype. Reusing it matters: a fresh buffer per tile is fresh pages per tile (glibc maps large
# blocks anew when the probes pin its mmap threshold), and faulting them in cost more than dequantising.
TILE_ELEMENTS = 1 << 18
# On a GPU the kernel launches, not the cache, set the cost: a 1 MiB tile is a few microseconds of work
# behind about ten launches, so tiles there are 16x larger (16 MiB of float32).
ACCELERATOR_TILE_ELEMENTS = 1 << 22
_SCRATCH = threading.local()


def tile_elements(device: torch.device | str) -> int:
    """Entries in one dequantised tile on `device`: TILE_ELEMENTS on a CPU, ACCELERATOR_TILE_ELEMENTS
    elsewhere."""
    return TILE_ELEMENTS if torch.device(device).type == "cpu" else ACCELERATOR_TILE_ELEMENTS


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


class PackedMatrix(nn.Module):
    """A frozen [rows, cols] matrix held packed (see the module docstring). Its tensors are buffers:
    nothing here trains."""

    def __init__(self, rows: int, cols: int, bits: int, group_size: int = GROUP_SIZE, device: Any = None,
                 dtype: torch.dtype = torch.float32, storage_dtype: torch.dtype = STORAGE_DTYPE,
                 zero_point: int | None = None) -> None:
        super().__init__()
        if bits not in SUPPORTED_BITS:
            raise EdgetrainError(f"quantised weights take {' or '.join(map(str, SUPPORTED_BITS))} bits, not {bits!r}")
        if group_size <= 0 or cols % group_size or (bits == 4 and group_size % 2):
            raise EdgetrainError(f"a layer of {cols} inputs cannot be cut into groups of {group_size}")
        self.rows, self.cols, self.bits, self.group_size = rows, cols, bits, group_size
        groups = cols // group_size
        self.register_buffer("codes", torch.zeros(rows, cols * bits // 8, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.zeros(rows, groups, dtype=storage_dtype, device=device))
        # A symmetric format (GGUF Q4_0, Q8_0) has w = scale * (q - zero_point): its bias is -zero_point *
        # scale in every group, so it is computed, not stored (an eighth of Q8_0's bytes).
        self.zero_point = _check_zero_point(zero_point, bits)
        biases = None if zero_point is not None else torch.zeros(rows, groups, dtype=storage_dtype, device=device)
        self.register_buffer("biases", biases)
        # Empty: it carries the dtype the layer computes in through .to() / .double() like any float tensor.
        self.register_buffer("_dtype_marker", torch.empty(0, dtype=dtype, device=device), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype this layer computes in and returns (the model's), not the packed storage's."""
        return self._dtype_marker.dtype

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "PackedMatrix":
        # A model-wide dtype cast must not round the stored scales (float16 -> bfloat16 loses bits): keep
        # their dtype, follow only the device. The marker takes the new dtype.
        stored = {name: getattr(self, name) for name in ("scales", "biases") if getattr(self, name) is not None}
        super()._apply(fn, recurse)
        for name, original in stored.items():
            applied = getattr(self, name)
            if applied.dtype != original.dtype:
                setattr(self, name, original.to(applied.device))
        return self

    def _work_dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        wanted = self.dtype if dtype is None else dtype
        return torch.float64 if torch.float64 in (wanted, self.scales.dtype) else torch.float32

    def _dequantize_packed(self, codes: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor | None,
                           dtype: torch.dtype | None, scratch: bool = False) -> torch.Tensor:
        """Dense rows from packed ones: one buffer (a scratch one when asked), filled with the integers and
        scaled in place."""
        work = self._work_dtype(dtype)
        wanted = self.dtype if dtype is None else dtype
        rows, device = codes.shape[0], codes.device
        scratch = scratch and not _under_functorch()
        if scratch and wanted == work:
            dense = _scratch("dense", rows * self.cols, work, device).view(rows, self.cols)
        else:
            dense = torch.empty(rows, self.cols, dtype=work, device=device)
        if self.bits == 4:  # byte i holds columns 2i (low nibble) and 2i + 1 (high nibble)
            pairs = dense.view(rows, self.cols // 2, 2)
            nibbles = (_scratch("nibbles", codes.numel(), torch.uint8, device).view(codes.shape) if scratch
                       else torch.empty_like(codes))
            pairs[..., 0].copy_(torch.bitwise_and(codes, 0x0F, out=nibbles))
            pairs[..., 1].copy_(torch.bitwise_right_shift(codes, 4, out=nibbles))
        else:
            dense.copy_(codes)
        grouped = dense.view(rows, -1, self.group_size)
        # Mixed dtypes in place: the scales convert inside the kernel (exactly), no launch of their own.
        if biases is None:
            # Exactly scale * q + (-zero_point * scale): q - zero_point is a small integer, and a float16
            # scale times it is exact in float32, as each of the two terms was.
            grouped.sub_(self.zero_point).mul_(scales.unsqueeze(-1))
        else:
            grouped.mul_(scales.unsqueeze(-1)).add_(biases.unsqueeze(-1))
        return dense if wanted == work else dense.to(wanted)

    def scratch_tiles(self, dtype: torch.dtype | None = None, device: Any = None,
                      rows_per_tile: int | None = None) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(start, stop, dense rows [start, stop)) covering the matrix, `rows_per_tile` rows at a time (as
        many as tile_elements(device) entries hold by default). Each tile lives in a scratch buffer that the
        next tile overwrites: use it before asking for the next."""
        step = rows_per_tile or max(1, tile_elements(self.device if device is None else device) // self.cols)
        for start in range(0, self.rows, step):
            stop = min(start + step, self.rows)
            yield start, stop, self.dequantize_rows(start, stop, dtype, device, scratch=True)

    def dequantize(self, dtype: torch.dtype | None = None, device: Any = None) -> torch.Tensor:
        """The whole dense [rows, cols] matrix in `dtype` (the layer's by default)."""
        return self.dequantize_rows(0, self.rows, dtype, device)

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype | None = None,
                        device: Any = None, scratch: bool = False) -> torch.Tensor:
        """Dense rows [start, stop); in this thread's scratch buffer with `scratch` (see scratch_tiles)."""
        codes, scales, biases = (t if t is None or device is None else t.to(device)
                                 for t in self._packed_rows(slice(start, stop)))
        return self._dequantize_packed(codes, scales, biases, dtype, scratch)

    def _packed_rows(self, index: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Codes, scales and biases (None for a symmetric format) of the rows `index` selects."""
        return self.codes[index], self.scales[index], None if self.biases is None else self.biases[index]

    def dequantize_gathered(self, indices: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dense rows `indices` (any shape of integers): [*indices.shape, cols]."""
        flat = indices.reshape(-1)
        dense = self._dequantize_packed(*self._packed_rows(flat), dtype)
        return dense.view(*indices.shape, self.cols)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised matrix, for code that reads a weight (an export, an estimate): built on each read."""
        return self.dequantize()

    def packed_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.biases) if t is not None)

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
        self.scales, self.biases, self.zero_point = scale.to(storage), low.to(storage), None

    def fill_from_packed(self, packed: Any) -> None:
        """From an edgetrain.models.gguf.packed.PackedWeight (GGUF blocks, moved, not requantised; its
        float16 scales and biases stay exact)."""
        codes = np.ascontiguousarray(packed.weight).view(np.uint8)  # little-endian words -> their bytes
        if codes.shape != tuple(self.codes.shape) or packed.bits != self.bits:
            raise EdgetrainError(f"packed weight of {codes.shape} bytes, {packed.bits} bits does not fit a "
                                 f"{tuple(self.codes.shape)}, {self.bits}-bit matrix")
        scales = np.asarray(packed.scales, dtype=np.float32)
        biases = np.asarray(packed.biases, dtype=np.float32)
        zero_point = symmetric_zero_point(scales, biases, self.bits)
        kept = (scales,) if zero_point is not None else (scales, biases)
        exact = all(np.array_equal(a.astype(np.float16).astype(np.float32), a) for a in kept)
        storage = STORAGE_DTYPE if exact else torch.float32
        self.codes = torch.from_numpy(codes)  # shares the packed words' buffer: no second copy
        self.scales = torch.from_numpy(scales).to(storage)
        self.biases = None if zero_point is not None else torch.from_numpy(biases).to(storage)
        self.zero_point = zero_point


def symmetric_zero_point(scales: np.ndarray, biases: np.ndarray, bits: int) -> int | None:
    """2**(bits - 1) when every group's bias is exactly -2**(bits - 1) * its scale (GGUF's Q4_0 and Q8_0 as
    edgetrain.models.gguf.packed lays them out), else None."""
    zero_point = 2 ** (bits - 1)
    return zero_point if np.array_equal(biases, np.float32(-zero_point) * scales) else None


def _check_zero_point(zero_point: int | None, bits: int) -> int | None:
    if zero_point is not None and (isinstance(zero_point, bool) or not isinstance(zero_point, int)
                                   or not 0 <= zero_point < 2 ** bits):
        raise EdgetrainError(f"a {bits}-bit zero point must be an integer in [0, {2 ** bits}), not {zero_point!r}")
    return zero_point


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
                 storage_dtype: torch.dtype = STORAGE_DTYPE, zero_point: int | None = None) -> None:
        super().__init__(out_features, in_features, bits, group_size, device, dtype, storage_dtype, zero_point)
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, bias={self.bias is not None}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = QuantizedMatmul.apply(x, self)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @classmethod
    def from_packed(cls, packed: Any, bias: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.float32) -> "QuantizedLinear":
        """From an edgetrain.models.gguf.packed.PackedWeight (GGUF blocks, moved, not requantised)."""
        rows, words = packed.weight.shape
        # Built on the meta device: its zero buffers would be a full-size allocation for nothing.
        layer = cls(words * 32 // packed.bits, rows, packed.bits, packed.group_size, bias is not None, device="meta",
                    dtype=dtype)
        layer.fill_from_packed(packed)
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
                 storage_dtype: torch.dtype = STORAGE_DTYPE, zero_point: int | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, bits, group_size, device, dtype, storage_dtype, zero_point)
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
    def from_packed(cls, packed: Any, dtype: torch.dtype = torch.float32) -> "QuantizedEmbedding":
        rows, words = packed.weight.shape
        table = cls(rows, words * 32 // packed.bits, packed.bits, packed.group_size, device="meta", dtype=dtype)
        table.fill_from_packed(packed)
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
