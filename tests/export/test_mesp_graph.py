"""The packed layouts a MeSP program dequantises in its graph (edgetrain/export/mesp_graph.py): every layout, tile
and gathered row gives the same float32 numbers, bit for bit, as edgetrain.models.quantized's own dequantisation
of the matrix as loaded. No ExecuTorch needed: the graph code runs eagerly here."""
from __future__ import annotations

import pytest
import torch

from edgetrain.export.mesp_graph import (GraphPackedMatrix, MatrixFormat, matrix_from_inputs, pack_row_halves,
                                        sign_codes)
from edgetrain.export.mesp_program import _matrix
from edgetrain.models.quantized import MatrixLayout, PackedMatrix


def packed(rows: int, cols: int, bits: int, zero_point: int | None) -> PackedMatrix:
    torch.manual_seed(rows + bits)
    matrix = PackedMatrix(rows, cols, bits, group_size=32)
    matrix.fill_from_dense(torch.randn(rows, cols))
    if zero_point is not None:  # a symmetric format (GGUF Q4_0, Q8_0): w = scale * (q - zero_point)
        matrix.biases, matrix.layout = None, MatrixLayout(bits, 32, zero_point)
    return matrix


def graph_matrix(matrix: PackedMatrix) -> GraphPackedMatrix:
    matrix_format, parts = _matrix(matrix)
    return matrix_from_inputs(matrix_format, iter(parts))


@pytest.mark.parametrize("bits,zero_point", [(4, None), (4, 8), (8, None), (8, 128)])
@pytest.mark.parametrize("rows", [96, 7])
def test_every_tile_and_gathered_row_equals_the_loaded_matrix_bit_for_bit(bits, zero_point, rows):
    matrix = packed(rows, 64, bits, zero_point)
    expected = matrix.dequantize(torch.float32)
    graph = graph_matrix(matrix)
    assert graph.format.row_halves == (bits == 4 and rows % 2 == 0)
    assert graph.format.signed == (bits == 8)
    assert graph.codes.dtype == (torch.uint8 if bits == 4 and rows % 2 else torch.int8)
    tiles = list(graph.scratch_tiles(rows_per_tile=20))
    assert [start for start, _, _ in tiles][0] == 0 and tiles[-1][1] == rows
    for start, stop, tile in tiles:
        assert torch.equal(tile, expected[start:stop]), (start, stop)
        if graph.format.row_halves:  # a tile stays within one nibble
            assert stop <= rows // 2 or start >= rows // 2
    assert torch.equal(graph.dequantize_rows(rows // 2 - 3, rows // 2 + 3), expected[rows // 2 - 3:rows // 2 + 3])
    indices = torch.tensor([[0, rows - 1, rows // 2], [rows // 2 - 1, 3, rows - 2]])
    assert torch.equal(graph.dequantize_gathered(indices), expected[indices])


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_row_halves_holds_the_upper_half_in_the_high_nibbles(bits):
    torch.manual_seed(bits)
    codes = torch.randint(0, 2 ** bits, (4, 6), dtype=torch.uint8)
    halves = pack_row_halves(codes)
    assert halves.shape == (2, 6) and halves.dtype == torch.int8
    assert torch.equal(halves & 15, codes[:2].to(torch.int8))
    assert torch.equal((halves & -16).float() + 128, 16 * codes[2:].float())  # 16 (q - 8) + 128
    # What the graph reads in floats: floor(b / 16) = q - 8 of the upper row, b - 16 floor(b / 16) = q of the lower.
    as_floats = halves.float()
    assert torch.equal(torch.floor(as_floats / 16) + 8, codes[2:].float())
    assert torch.equal(as_floats - 16 * torch.floor(as_floats / 16), codes[:2].float())
    with pytest.raises(ValueError, match="even number of rows"):
        pack_row_halves(codes[:3])
    assert MatrixFormat(4, 6, 4, 2, None, True).to_json()["row_halves"] is True


@pytest.mark.parametrize("bits", [5, 6])
def test_row_quarters_holds_three_codes_whole_and_the_fourth_in_their_low_bits(bits):
    """Byte (p R + i, c), p < 3: row p R + i's code xor its top bit in the top `bits` bits, bits [k p, k (p + 1))
    of row 3 R + i's in the low k = 8 - bits. What the graph computes in floats gives every code back, for every
    code in every quarter."""
    from edgetrain.export.mesp_graph import _last_quarter_codes, _whole_codes, pack_row_quarters

    every_code = torch.arange(2 ** bits, dtype=torch.uint8)
    codes = torch.stack([every_code, every_code.flip(0), every_code.roll(7), every_code.roll(-11)])  # R = 1
    quarters = pack_row_quarters(codes, bits)
    assert quarters.shape == (3, 2 ** bits) and quarters.dtype == torch.int8  # 6 bits a code
    low_bits = 8 - bits
    as_unsigned = quarters.view(torch.uint8).to(torch.int32)
    assert torch.equal(as_unsigned >> low_bits, codes[:3].to(torch.int32) ^ 2 ** (bits - 1))
    pieces = as_unsigned & (2 ** low_bits - 1)
    assert torch.equal(sum(pieces[p] << (low_bits * p) for p in range(3)), codes[3].to(torch.int32))
    as_floats = quarters.to(torch.float32)
    assert torch.equal(_whole_codes(as_floats, bits) + 2 ** (bits - 1), codes[:3].to(torch.float32))
    parts = -(-bits // low_bits)  # the bytes a last-quarter code needs: 2 for 5 bits (3 + 2), 3 for 6 (2 + 2 + 2)
    assert MatrixFormat(4, 2 ** bits, bits, row_quarters=True).last_quarter_parts == parts
    assert torch.equal(_last_quarter_codes(list(as_floats[:parts]), bits), codes[3].to(torch.float32))
    with pytest.raises(ValueError, match="rows of a multiple of 4"):
        pack_row_quarters(codes[:3], bits)


def test_signed_codes_are_q_minus_128():
    codes = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(sign_codes(codes).to(torch.int32), codes.to(torch.int32) - 128)


def test_a_traced_packed_linear_is_its_tiles_side_by_side():
    from edgetrain.methods.mesp.ops import LinearWeights

    matrix = packed(96, 64, 4, None)
    bias = torch.randn(96)
    x = torch.randn(5, 64)
    expected = torch.nn.functional.linear(x, matrix.dequantize(torch.float32), bias)
    traced = LinearWeights(None, bias, packed=graph_matrix(matrix)).forward(x)
    eager = LinearWeights(None, bias, packed=matrix).forward(x)
    torch.testing.assert_close(traced, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(traced, eager, rtol=1e-6, atol=1e-6)


def gguf_matrix(type_name: str, rows: int, cols: int = 512, seed: int = 0):
    """A QuantizedLinear of `rows` x `cols` random blocks of a GGUF type, as loaded."""
    from edgetrain.models.gguf.blocks import BLOCK_FORMATS
    from edgetrain.models.gguf.packed_rows import split_rows
    from edgetrain.models.quantized import QuantizedLinear
    from gguf_blocks_testkit import random_blocks

    type_id = next(t for t, f in BLOCK_FORMATS.items() if f.name == type_name)
    fmt = BLOCK_FORMATS[type_id]
    raw = random_blocks(type_name, rows * cols // fmt.block_values, seed=seed).reshape(-1)
    return QuantizedLinear.from_rows(split_rows(raw, type_id, (rows, cols)))


def assert_every_tile_and_gathered_row_equal(graph: GraphPackedMatrix, expected: torch.Tensor, rows_per_tile: int):
    """Every tile of scratch_tiles, ranges that straddle a half or a quarter, and every row gathered equal
    `expected`, bit for bit; no tile straddles a half of a row_halves layout or a quarter of a row_quarters one."""
    rows = expected.shape[0]
    parts = 2 if graph.format.row_halves else 4 if graph.format.row_quarters else 1
    bounds = [rows * part // parts for part in range(1, parts)]
    tiles = list(graph.scratch_tiles(rows_per_tile=rows_per_tile))
    assert tiles[0][0] == 0 and tiles[-1][1] == rows and all(a[1] == b[0] for a, b in zip(tiles, tiles[1:]))
    for start, stop, tile in tiles:
        assert torch.equal(tile, expected[start:stop]), (start, stop)
        assert not any(start < bound < stop for bound in bounds), (start, stop, bounds)
    for start, stop in [(bound - 3, bound + 2) for bound in bounds] + [(1, rows - 1), (0, 1), (rows - 1, rows)]:
        start, stop = max(0, start), min(rows, stop)
        assert torch.equal(graph.dequantize_rows(start, stop), expected[start:stop]), (start, stop)
    assert torch.equal(graph.dequantize_rows(0, rows), expected)
    every_row = torch.arange(rows)
    indices = torch.stack([every_row, every_row.flip(0)])
    assert torch.equal(graph.dequantize_gathered(indices), expected[indices])


# The layout each GGUF type's codes take for a number of rows: row_halves up to 4 bits (rows even), row_quarters for
# 5 and 6 (rows a multiple of 4), wide where the rows do not split; 8 bits signed, and 4-bit odd rows as loaded.
ROWS = (32, 20, 14, 7)
LAYOUT_FOR_ROWS = {
    **{(bits, rows): "row_halves" for bits in (2, 3, 4) for rows in ROWS[:3]},
    **{(bits, rows): "row_quarters" for bits in (5, 6) for rows in ROWS[:2]},
    **{(bits, 14): "wide" for bits in (5, 6)}, **{(bits, 7): "wide" for bits in (2, 3, 5, 6)}, (4, 7): "as loaded",
    **{(8, rows): "signed" for rows in ROWS}}


def layout_name(matrix_format: MatrixFormat) -> str:
    return next((name for name in ("row_halves", "row_quarters", "wide", "signed") if getattr(matrix_format, name)),
                "as loaded")


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                                       "Q6_K"])
@pytest.mark.parametrize("rows", ROWS)
def test_every_affine_gguf_format_dequantises_in_the_graph_as_loaded_bit_for_bit(type_name, rows):
    """Each layout (row_halves, row_quarters, wide, signed, as loaded) and the k-quants'
    block scales times group steps: every tile (a few rows a tile, and a whole matrix's worth, cut at the halves
    or quarters) and gathered row equals edgetrain.models.quantized's dequantisation of the file's blocks, bit for
    bit."""
    matrix = gguf_matrix(type_name, rows, seed=rows)
    expected = matrix.dequantize(torch.float32)
    graph = graph_matrix(matrix)
    assert layout_name(graph.format) == LAYOUT_FOR_ROWS[(matrix.bits, rows)]
    layout = matrix.layout
    assert graph.format.block_values == (layout.block_values if layout.steps else 0)
    if graph.format.row_quarters:  # three bytes for four codes: 6 bits a code, not 8
        assert graph.codes.shape == (rows * 3 // 4, 512) and graph.codes.dtype == torch.int8
    for rows_per_tile in (5, 12, rows):
        assert_every_tile_and_gathered_row_equal(graph, expected, rows_per_tile)


# Formats a projection's blocks mix, and the common layout that holds them: 6 bits (row_quarters, code offset 32) for a
# Q4_K_M file's Q4_K (0 to 15) and Q6_K (-32 to 31) ffn_down, or Q4_0 (-8 to 7) beside Q5_1 (0 to 31); 5 bits for
# Q4_0 beside Q5_0 (-16 to 15) or Q4_K beside Q3_K (-4 to 3); 4 bits (row_halves) for Q4_0 beside Q3_K; a code a
# byte with an 8-bit format among them, or where the rows do not split.
COMMON_CASES = [(["Q4_K", "Q6_K", "Q3_K", "Q8_0", "Q5_1"], 6, "wide", 16, 32, 0),
                (["Q4_K", "Q6_K"], 16, "row_quarters", 16, 256, 32),
                (["Q6_K", "Q4_K", "Q2_K"], 12, "row_quarters", 16, 256, 32),
                (["Q4_0", "Q5_1"], 8, "row_quarters", 32, 32, 8),
                (["Q4_0", "Q5_1"], 10, "wide", 32, 32, 0),
                (["Q4_0", "Q5_0"], 16, "row_quarters", 32, 32, 16),
                (["Q4_K", "Q3_K"], 24, "row_quarters", 16, 256, 4),
                (["Q4_K", "Q3_K"], 22, "wide", 16, 256, 0),
                (["Q4_0", "Q3_K"], 6, "row_halves", 16, 32, 8)]


@pytest.mark.parametrize("type_names,rows,layout,group_size,block_values,code_offset", COMMON_CASES)
def test_one_projection_in_several_formats_shares_a_common_format_that_holds_each_exactly(
        type_names, rows, layout, group_size, block_values, code_offset):
    """_common_matrices: a subtracted minimum (Q4_K, Q2_K), groups of 16 with zero points (Q6_K, Q3_K), one scale
    a block (Q8_0, Q5_1, Q4_0) in one format: every tile and gathered row equals each matrix's own
    dequantisation, bit for bit."""
    from edgetrain.export.mesp_program import _common_matrices

    modules = [gguf_matrix(type_name, rows, seed=seed) for seed, type_name in enumerate(type_names)]
    common = _common_matrices(modules)
    assert len({matrix_format for matrix_format, _ in common}) == 1
    matrix_format = common[0][0]
    assert (layout_name(matrix_format), matrix_format.group_size, matrix_format.block_values,
            matrix_format.code_offset) == (layout, group_size, block_values, code_offset)
    for module, (matrix_format, parts) in zip(modules, common):
        graph = matrix_from_inputs(matrix_format, iter(parts))
        assert_every_tile_and_gathered_row_equal(graph, module.dequantize(torch.float32), rows_per_tile=3)
