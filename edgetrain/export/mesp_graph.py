"""The pieces of a MeSP step as traceable modules: what `edgetrain export --method mesp` lowers to ExecuTorch.

Each piece is an ordinary forward graph over plain tensor inputs. The frozen weights and the adapters are
inputs too, not constants, so one block program serves every block and the program does not grow with
depth. The arithmetic is edgetrain/methods/mesp's own (block_forward, block_backward, chunked_lm_loss),
called on tensors the piece unpacks from its inputs; a packed matrix is dequantised inside the graph a tile
of rows at a time (`GraphPackedMatrix`, the same integers and scales as edgetrain.models.quantized), so a
step never holds a block's dense weights.

    embed(token_ids, *embedding)                          -> hidden [B, T, D]
    block_forward(x, cos, sin, adapters, *frozen)         -> the block's output
    block_backward(x, grad_out, cos, sin, adapters, *frozen) -> (dL/dx, dL/d(adapters))
    head(hidden, targets, norm, *lm_head)                 -> (mean loss, dL/dhidden)
    adamw(adapters, grad, exp_avg, exp_avg_sq, scalars)   -> (adapters, exp_avg, exp_avg_sq)

`adapters` is a block's LoRA A and B matrices flattened into one vector, in PROJECTIONS order, A before B.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from edgetrain.methods.mesp.block import PROJECTIONS, BlockWeights, block_backward, block_forward
from edgetrain.methods.mesp.loss import chunked_lm_loss
from edgetrain.methods.mesp.ops import LinearWeights
from edgetrain.models.quantized import TILE_ELEMENTS

# adamw's scalars, in the order of its last input (computed by the driver in double, as torch.optim does,
# then rounded to float32 as torch rounds a Python scalar for a float32 kernel).
ADAMW_SCALARS = ("decay", "one_minus_beta1", "beta2", "one_minus_beta2", "bias_correction2_sqrt", "eps",
                 "neg_step_size")


@dataclass(frozen=True)
class MatrixFormat:
    """How one frozen matrix is held: dense float32 (bits None), or packed as edgetrain.models.quantized
    holds it (codes, scales, and biases unless the format is symmetric with a zero point).

    The export stores packed codes as int8, since XNNPACK converts int8 to float (as a dequantisation with
    scale 1, edgetrain/export/executorch.py) where ExecuTorch's own conversion goes one element at a time:
    - 8 bits (`signed`): q - 128.
    - at most 4 bits (Q4_0, Q4_1, Q4_K; Q3_K and Q2_K take a nibble too), `row_halves` (rows even): int8
      [rows/2, cols], byte (r, c) holds row r's column c in its low nibble and row r + rows/2's, plus 8 modulo
      16, in its high one (pack_row_halves). Read as a signed byte b, floor(b / 16) is then the high row's q - 8
      and b - 16 floor(b / 16) the low row's q: a tile of rows from either half is a few float operations
      XNNPACK runs. Integer masks would run on ExecuTorch's portable kernels, about 1 ns a byte (a sixth of a
      block forward's time).
    - 5 or 6 bits (Q5_0, Q5_1, Q5_K, Q6_K), `row_quarters` (rows a multiple of 4): int8 [3 rows/4, cols], three
      bytes for every four codes. With R = rows/4 and k = 8 - bits (3 or 2), byte (p R + i, c), p = 0, 1, 2,
      holds row p R + i's code, xor its top bit, in its top `bits` bits, and bits [k p, k (p + 1)) of row
      3 R + i's code in its low k bits (pack_row_quarters). Read as a signed byte b, floor(b / 2^k) is then the
      whole row's q - 2^(bits - 1) (three quarters of the rows: one conversion, a multiply and a floor, like a
      nibble, and a symmetric format's zero point of 2^(bits - 1) cancels), and b - 2^k floor(b / 2^k) a part
      of the last quarter's q, which two (5 bits) or three (6 bits) such parts add up to. A tile stays within
      one quarter. A code takes 6 bits where a byte a code took 8. A 5-bit layout for 5-bit codes (their low bits
      in row halves, a plane of high bits) took about twice the float operations a row: SmolLM2 Q4_K_M's runner
      took 16% longer a step than with a byte a code, with row quarters 3-8% (docs/export.md).
    - `code_offset`: the row_halves and row_quarters codes of _common_matrices' narrow format hold
      q + code_offset (its codes are signed; those layouts' are not).
    - 4 bits, odd rows: uint8 as loaded (byte i of a row holds columns 2i and 2i + 1), unpacked by a
      per-element concatenation; rare (every GGUF matrix has even rows), and slow.
    - `wide`: int8 [rows, cols], a code a byte, less the zero point of a symmetric format: codes of 2, 3, 5 or 6
      bits whose rows do not split as above, and the common format of a projection some of whose blocks hold
      8-bit codes.
    With `block_values` (the k-quants), a group's scale is the block's stored scale (f16, one per
    `block_values` columns) times the group's integer step (`scale_steps`, int8), and likewise its bias
    (`bias_steps`; `subtracts_bias`: w = scale q - bias, ggml's minimum), as edgetrain.models.quantized
    computes them.
    All of it is exact (small integers; a power of two; an f16 times an integer of at most 8 bits), so the
    numbers are edgetrain.models.quantized's, bit for bit."""

    rows: int
    cols: int
    bits: int | None = None
    group_size: int = 0
    zero_point: int | None = None
    row_halves: bool = False
    signed: bool = False
    wide: bool = False
    block_values: int = 0  # > 0: stored scales (and biases) a block of this many columns, times group steps
    subtracts_bias: bool = False
    row_quarters: bool = False
    code_offset: int = 0

    @property
    def last_quarter_parts(self) -> int:
        """Bytes whose low bits hold a last-quarter row's code in row_quarters: 2 for 5 bits, 3 for 6."""
        return -(-self.bits // (8 - self.bits))

    @property
    def packed(self) -> bool:
        return self.bits is not None

    @property
    def parts(self) -> tuple[str, ...]:
        """The names of its input tensors."""
        if not self.packed:
            return ("weight",)
        steps = self.block_values > 0
        names = ["codes", "scales"] + (["scale_steps"] if steps else [])
        if self.zero_point is None:
            names += ["biases"] + (["bias_steps"] if steps else [])
        return tuple(names)

    def to_json(self) -> dict:
        return {"rows": self.rows, "cols": self.cols, "bits": self.bits, "group_size": self.group_size,
                "zero_point": self.zero_point, "row_halves": self.row_halves, "signed": self.signed,
                "wide": self.wide, "block_values": self.block_values, "subtracts_bias": self.subtracts_bias,
                "row_quarters": self.row_quarters, "code_offset": self.code_offset}


# What a signed 8-bit code is short of its q (MatrixFormat.signed).
SIGNED_CODE_SHIFT = 128
# What a row_halves high nibble, read as floor(b / 16), is short of its q.
HIGH_NIBBLE_SHIFT = 8


def pack_row_halves(codes: torch.Tensor) -> torch.Tensor:
    """Codes of at most 4 bits, uint8 [rows, cols] -> int8 [rows/2, cols] in the row_halves layout
    (MatrixFormat). rows must be even."""
    rows = codes.shape[0]
    if rows % 2:
        raise ValueError(f"the row_halves layout needs an even number of rows, not {rows}")
    high = torch.bitwise_xor(codes[rows // 2:], HIGH_NIBBLE_SHIFT)  # read back signed: 16 (q - 8) + low
    return torch.bitwise_or(codes[:rows // 2], torch.bitwise_left_shift(high, 4)).view(torch.int8)


def pack_row_quarters(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of 5 or 6 bits, uint8 [rows, cols] -> int8 [3 rows/4, cols] in the row_quarters layout
    (MatrixFormat). rows must be a multiple of 4."""
    rows = codes.shape[0]
    if rows % 4 or bits not in (5, 6):
        raise ValueError(f"the row_quarters layout takes 5- or 6-bit codes in rows of a multiple of 4, not "
                         f"{bits}-bit codes in {rows}")
    quarter, low_bits = rows // 4, 8 - bits
    last = codes[3 * quarter:]
    parts = []
    for part in range(3):
        # xor the top bit: read back signed, the top bits are q - 2^(bits - 1).
        whole = torch.bitwise_xor(codes[part * quarter:(part + 1) * quarter], 2 ** (bits - 1))
        piece = torch.bitwise_and(torch.bitwise_right_shift(last, low_bits * part), 2 ** low_bits - 1)
        parts.append(torch.bitwise_or(torch.bitwise_left_shift(whole, low_bits), piece))
    return torch.cat(parts).view(torch.int8)


def sign_codes(codes: torch.Tensor) -> torch.Tensor:
    """8-bit codes (uint8 q) -> int8 q - 128 (MatrixFormat.signed)."""
    return torch.bitwise_xor(codes, SIGNED_CODE_SHIFT).view(torch.int8)


def _high_nibbles(bytes_as_floats: torch.Tensor) -> torch.Tensor:
    """floor(b / 16): q - 8 of the row in a row_halves byte's high nibble."""
    return torch.floor(bytes_as_floats * 0.0625)


def _low_nibbles(bytes_as_floats: torch.Tensor, high_nibbles: torch.Tensor | None = None) -> torch.Tensor:
    """b - 16 floor(b / 16): q of the row in a row_halves byte's low nibble (floor(b / 16) given, or computed)."""
    high = _high_nibbles(bytes_as_floats) if high_nibbles is None else high_nibbles
    return bytes_as_floats - high * 16.0


def _whole_codes(bytes_as_floats: torch.Tensor, bits: int) -> torch.Tensor:
    """floor(b / 2^(8 - bits)): q - 2^(bits - 1) of the row whose code a row_quarters byte holds whole."""
    return torch.floor(bytes_as_floats * 2.0 ** (bits - 8))


def _last_quarter_codes(parts_as_floats: list[torch.Tensor], bits: int) -> torch.Tensor:
    """q of last-quarter rows from their row_quarters bytes b_p (p = 0, 1 (, 2)): the sum of
    2^(k p) (b_p - 2^k floor(b_p / 2^k)), k = 8 - bits."""
    low_bits = 8 - bits
    codes = None
    for part, bytes_as_floats in enumerate(parts_as_floats):
        piece = bytes_as_floats - _whole_codes(bytes_as_floats, bits) * float(2 ** low_bits)
        codes = piece if codes is None else codes + piece * float(2 ** (low_bits * part))
    return codes


class GraphPackedMatrix:
    """A packed matrix whose dequantisation is traced into the graph. It offers what mesp's code reads of
    edgetrain.models.quantized's layers: rows/cols, scratch_tiles (LinearWeights), and out_features,
    dequantize_rows, dequantize_gathered (chunked_lm_loss)."""

    def __init__(self, matrix_format: MatrixFormat, codes: torch.Tensor, scales: torch.Tensor,
                 biases: torch.Tensor | None, scale_steps: torch.Tensor | None = None,
                 bias_steps: torch.Tensor | None = None) -> None:
        self.format = matrix_format
        self.rows = self.out_features = matrix_format.rows
        self.cols = matrix_format.cols
        self.codes, self.scales, self.biases = codes, scales, biases
        self.scale_steps, self.bias_steps = scale_steps, bias_steps

    def _group_values(self, stored: torch.Tensor, steps: torch.Tensor | None) -> torch.Tensor:
        """[rows, groups, 1] float32: the stored values, or each block's times its groups' steps."""
        rows, groups = stored.shape[0], self.cols // self.format.group_size
        if steps is None:
            # view, not unsqueeze: ExecuTorch runs a view as an alias of the same memory, an unsqueeze as a copy.
            return stored.to(torch.float32).view(rows, groups, 1)
        blocks = self.cols // self.format.block_values
        per_block = groups // blocks
        values = stored.to(torch.float32).view(rows, blocks, 1) * steps.to(torch.float32).view(rows, blocks, per_block)
        return values.view(rows, groups, 1)

    def _dense(self, integers: torch.Tensor, shift: int, rows_slice: slice | torch.Tensor) -> torch.Tensor:
        """Dense rows from their integers as floats, each `shift` short of its q, and the scales and biases of
        the rows `rows_slice` picks: scale (q - zero point), or scale q + bias (- bias), as
        edgetrain.models.quantized computes them."""
        rows = integers.shape[0]
        groups = self.cols // self.format.group_size
        grouped = integers.view(rows, groups, self.format.group_size)
        pick = (lambda t: None if t is None else t[rows_slice])
        scales = self._group_values(pick(self.scales), pick(self.scale_steps))
        if self.biases is None:
            zero = self.format.zero_point - shift
            dense = (grouped - zero if zero else grouped) * scales
        else:
            biases = self._group_values(pick(self.biases), pick(self.bias_steps))
            scaled = (grouped + shift if shift else grouped) * scales
            dense = scaled - biases if self.format.subtracts_bias else scaled + biases
        return dense.view(rows, self.cols)

    def _integers(self, codes: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The integers of unsplit codes (8 bits, wide, or 4 bits as loaded) as floats, and their shift (_dense)."""
        if self.format.wide:
            return codes.to(torch.float32), self.format.zero_point or 0
        if self.format.bits == 4:
            # A right shift is not in the Core ATen opset ExecuTorch runs; floor division by 16 is the same on
            # unsigned bytes.
            low = torch.bitwise_and(codes, 15)
            high = torch.div(codes, 16, rounding_mode="floor")
            return torch.stack([low, high], dim=-1).reshape(codes.shape[0], self.cols).to(torch.float32), 0
        return codes.to(torch.float32), SIGNED_CODE_SHIFT if self.format.signed else 0

    def _tile_bounds(self) -> list[int]:
        """The row indices a tile may not straddle, the last the end: each half of a row_halves layout (a tile
        reads one nibble), each quarter of a row_quarters one."""
        parts = 2 if self.format.row_halves else 4 if self.format.row_quarters else 1
        return [self.rows * part // parts for part in range(1, parts + 1)]

    def _quarter_tile(self, start: int, stop: int) -> torch.Tensor:
        """Dense rows [start, stop) of a row_quarters layout, within one quarter."""
        quarter, bits, offset = self.rows // 4, self.format.bits, self.format.code_offset
        if stop <= 3 * quarter:
            integers = _whole_codes(self.codes[start:stop].to(torch.float32), bits)
            return self._dense(integers, 2 ** (bits - 1) - offset, slice(start, stop))
        first, last = start - 3 * quarter, stop - 3 * quarter
        parts = [self.codes[part * quarter + first:part * quarter + last].to(torch.float32)
                 for part in range(self.format.last_quarter_parts)]
        return self._dense(_last_quarter_codes(parts, bits), -offset, slice(start, stop))

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype | None = None, device: object = None,
                        scratch: bool = False) -> torch.Tensor:
        if not (self.format.row_halves or self.format.row_quarters):
            return self._dense(*self._integers(self.codes[start:stop]), slice(start, stop))
        # scratch_tiles never straddles a bound; a caller cutting its own tiles (the head's vocabulary tiles) may.
        cuts = [start] + [bound for bound in self._tile_bounds() if start < bound < stop] + [stop]
        tile = self._quarter_tile if self.format.row_quarters else self._half_tile
        pieces = [tile(begin, end) for begin, end in zip(cuts, cuts[1:])]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _half_tile(self, start: int, stop: int) -> torch.Tensor:
        """Dense rows [start, stop) of a row_halves layout, within one half."""
        half, offset = self.rows // 2, self.format.code_offset
        if stop <= half:
            return self._dense(_low_nibbles(self.codes[start:stop].to(torch.float32)), -offset, slice(start, stop))
        return self._dense(_high_nibbles(self.codes[start - half:stop - half].to(torch.float32)),
                           HIGH_NIBBLE_SHIFT - offset, slice(start, stop))

    def dequantize_gathered(self, indices: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        flat = indices.reshape(-1)
        if self.format.row_quarters:
            return self._gathered_quarters(flat).view(*indices.shape, self.cols)
        if not self.format.row_halves:
            dense = self._dense(*self._integers(self.codes[flat]), flat)
            return dense.view(*indices.shape, self.cols)
        half = self.rows // 2
        upper = flat >= half
        bytes_as_floats = self.codes[torch.where(upper, flat - half, flat)].to(torch.float32)
        high = _high_nibbles(bytes_as_floats)
        integers = torch.where(upper.unsqueeze(-1), high + HIGH_NIBBLE_SHIFT, _low_nibbles(bytes_as_floats, high))
        return self._dense(integers, -self.format.code_offset, flat).view(*indices.shape, self.cols)

    def _gathered_quarters(self, flat: torch.Tensor) -> torch.Tensor:
        """Dense rows `flat` of a row_quarters layout: a whole row's byte is the row itself; a last-quarter row
        i reads bytes i, R + i (and 2 R + i), R = rows/4."""
        quarter, bits = self.rows // 4, self.format.bits
        last = flat >= 3 * quarter
        within = torch.where(last, flat - 3 * quarter, flat)
        parts = [self.codes[torch.where(last, within + part * quarter, flat)].to(torch.float32)
                 for part in range(self.format.last_quarter_parts)]
        whole = _whole_codes(parts[0], bits) + float(2 ** (bits - 1))
        integers = torch.where(last.unsqueeze(-1), _last_quarter_codes(parts, bits), whole)
        return self._dense(integers, -self.format.code_offset, flat)

    def tiled_product(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T a tile of rows at a time, the tiles' products side by side: one concatenation (XNNPACK's) where
        writing each into a slice of the output was a portable slice_scatter copying the whole output each time."""
        products = [x @ tile.t() for _, _, tile in self.scratch_tiles()]
        return products[0] if len(products) == 1 else torch.cat(products, dim=1)

    def scratch_tiles(self, dtype: torch.dtype | None = None, device: object = None,
                      rows_per_tile: int | None = None) -> Iterator[tuple[int, int, torch.Tensor]]:
        # Tiles as the eager path cuts them: the memory planner then holds one dense tile at a time. A tile of
        # row_halves stays within one half (one nibble), of row_quarters within one quarter.
        step = rows_per_tile or max(1, TILE_ELEMENTS // self.cols)
        begin = 0
        for end in self._tile_bounds():
            for start in range(begin, end, step):
                stop = min(start + step, end)
                yield start, stop, self.dequantize_rows(start, stop)
            begin = end


def matrix_from_inputs(matrix_format: MatrixFormat, tensors: Iterator[torch.Tensor]) -> torch.Tensor | GraphPackedMatrix:
    """The dense weight, or a GraphPackedMatrix, from the next len(format.parts) inputs."""
    if not matrix_format.packed:
        return next(tensors)
    named = {part: next(tensors) for part in matrix_format.parts}
    return GraphPackedMatrix(matrix_format, named["codes"], named["scales"], named.get("biases"),
                             named.get("scale_steps"), named.get("bias_steps"))


@dataclass(frozen=True)
class ProjectionLayout:
    """One of a block's seven projections, the same in every block."""

    name: str
    matrix: MatrixFormat
    has_bias: bool
    rank: int          # 0 without an adapter
    scale: float

    def adapter_numel(self) -> int:
        return self.rank * (self.matrix.rows + self.matrix.cols)


@dataclass(frozen=True)
class BlockLayout:
    """What every block of the model computes with, which the block programs unpack from their inputs."""

    projections: tuple[ProjectionLayout, ...]
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_chunk: int
    mlp_chunk: int
    head_norms: bool = False  # Qwen3's RMSNorms over each head's q and k, inputs after the two block norms

    def frozen_names(self) -> list[str]:
        """Block-relative names of the frozen inputs, in order (the norms, then the projections)."""
        names = ["input_layernorm", "post_attention_layernorm"]
        if self.head_norms:
            names += ["self_attn.q_norm", "self_attn.k_norm"]
        for projection in self.projections:
            names += [f"{projection.name}.{part}" for part in projection.matrix.parts]
            if projection.has_bias:
                names.append(f"{projection.name}.bias")
        return names

    def adapter_numel(self) -> int:
        return sum(projection.adapter_numel() for projection in self.projections)

    def adapter_slices(self) -> list[tuple[str, str, int, tuple[int, int]]]:
        """(projection, "lora_A" or "lora_B", offset, shape) of each adapter matrix in the flat vector."""
        slices, offset = [], 0
        for projection in self.projections:
            if not projection.rank:
                continue
            for part, shape in (("lora_A", (projection.rank, projection.matrix.cols)),
                                ("lora_B", (projection.matrix.rows, projection.rank))):
                slices.append((projection.name, part, offset, shape))
                offset += shape[0] * shape[1]
        return slices

    def weights(self, adapters: torch.Tensor, frozen: tuple[torch.Tensor, ...]) -> BlockWeights:
        inputs = iter(frozen)
        input_norm, post_attention_norm = next(inputs), next(inputs)
        q_norm, k_norm = (next(inputs), next(inputs)) if self.head_norms else (None, None)
        adapter_views: dict[tuple[str, str], torch.Tensor] = {
            (name, part): adapters[offset:offset + shape[0] * shape[1]].view(shape)
            for name, part, offset, shape in self.adapter_slices()}
        linears = {}
        for projection in self.projections:
            matrix = matrix_from_inputs(projection.matrix, inputs)
            bias = next(inputs) if projection.has_bias else None
            dense, packed = (None, matrix) if isinstance(matrix, GraphPackedMatrix) else (matrix, None)
            linears[projection.name] = LinearWeights(
                dense, bias, adapter_views.get((projection.name, "lora_A")),
                adapter_views.get((projection.name, "lora_B")), projection.scale, packed=packed)
        return BlockWeights(input_norm, post_attention_norm, self.eps, linears, self.num_heads, self.num_kv_heads,
                            self.head_dim, q_norm, k_norm)


class EmbedPiece(nn.Module):
    def __init__(self, table: MatrixFormat) -> None:
        super().__init__()
        self.table = table

    def forward(self, token_ids: torch.Tensor, *table: torch.Tensor) -> torch.Tensor:
        matrix = matrix_from_inputs(self.table, iter(table))
        if isinstance(matrix, GraphPackedMatrix):
            return matrix.dequantize_gathered(token_ids)
        return F.embedding(token_ids, matrix)


class BlockForwardPiece(nn.Module):
    def __init__(self, layout: BlockLayout) -> None:
        super().__init__()
        self.layout = layout

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, adapters: torch.Tensor,
                *frozen: torch.Tensor) -> torch.Tensor:
        return block_forward(self.layout.weights(adapters, frozen), x, (cos, sin),
                             attention_chunk=self.layout.attention_chunk, mlp_chunk=self.layout.mlp_chunk)


class BlockBackwardPiece(nn.Module):
    def __init__(self, layout: BlockLayout) -> None:
        super().__init__()
        self.layout = layout

    def forward(self, x: torch.Tensor, grad_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                adapters: torch.Tensor, *frozen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights = self.layout.weights(adapters, frozen)
        # A copy, so the program never writes its input (block_backward reuses the buffer for dL/dx).
        grad_x, grads = block_backward(weights, x, grad_out.clone(), (cos, sin), overwrite_grad_out=True,
                                       attention_chunk=self.layout.attention_chunk,
                                       mlp_chunk=self.layout.mlp_chunk)
        # block_backward names them by module path in PROJECTIONS order, A before B: the vector's order.
        flat = [grads[name].reshape(-1) for name in weights.lora_parameter_names()]
        return grad_x, torch.cat(flat) if flat else adapters.new_zeros(0)


class HeadPiece(nn.Module):
    def __init__(self, lm_head: MatrixFormat, eps: float, loss_chunk: int, vocab_chunk: int) -> None:
        super().__init__()
        self.lm_head, self.eps, self.loss_chunk, self.vocab_chunk = lm_head, eps, loss_chunk, vocab_chunk

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor, norm: torch.Tensor,
                *lm_head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        matrix = matrix_from_inputs(self.lm_head, iter(lm_head))
        return chunked_lm_loss(hidden, norm, self.eps, matrix, targets, self.loss_chunk, self.vocab_chunk)


class AdamWPiece(nn.Module):
    """torch.optim.AdamW's single-tensor update (edgetrain/backends/torch/eager_optimizers.py), with the
    step-dependent scalars as an input."""

    def forward(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                scalars: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        decay, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size = scalars.unbind()
        param = param * decay
        exp_avg = exp_avg + one_minus_beta1 * (grad - exp_avg)
        exp_avg_sq = exp_avg_sq * beta2 + one_minus_beta2 * grad * grad
        denom = exp_avg_sq.sqrt() / bias_correction2_sqrt + eps
        return param + neg_step_size * exp_avg / denom, exp_avg, exp_avg_sq

