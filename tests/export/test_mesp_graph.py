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


def test_row_halves_holds_the_upper_half_in_the_high_nibbles():
    integers = torch.arange(4 * 6, dtype=torch.uint8).reshape(4, 6) % 16
    loaded = integers[:, 0::2] | (integers[:, 1::2] << 4)  # byte i: columns 2i, 2i + 1
    halves = pack_row_halves(loaded)
    assert halves.shape == (2, 6) and halves.dtype == torch.int8
    assert torch.equal(halves & 15, integers[:2].to(torch.int8))
    assert torch.equal((halves & -16).float() + 128, 16 * integers[2:].float())  # 16 (q - 8) + 128
    # What the graph reads in floats: floor(b / 16) = q - 8 of the upper row, b - 16 floor(b / 16) = q of the lower.
    as_floats = halves.float()
    assert torch.equal(torch.floor(as_floats / 16) + 8, integers[2:].float())
    assert torch.equal(as_floats - 16 * torch.floor(as_floats / 16), integers[:2].float())
    with pytest.raises(ValueError, match="even number of rows"):
        pack_row_halves(loaded[:3])
    assert MatrixFormat(4, 6, 4, 2, None, True).to_json()["row_halves"] is True


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


@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("rows", [12, 7])
def test_every_affine_gguf_format_dequantises_in_the_graph_as_loaded_bit_for_bit(type_name, rows):
    """The wide layout (a code a byte) and the k-quants' block scales times group steps: every tile and
    gathered row equals edgetrain.models.quantized's dequantisation of the file's blocks, bit for bit."""
    from edgetrain.models.gguf.blocks import BLOCK_FORMATS
    from edgetrain.models.gguf.packed_rows import split_rows
    from edgetrain.models.quantized import QuantizedLinear
    from gguf_blocks_testkit import random_blocks

    type_id = next(t for t, f in BLOCK_FORMATS.items() if f.name == type_name)
    fmt, cols = BLOCK_FORMATS[type_id], 512
    raw = random_blocks(type_name, rows * cols // fmt.block_values, seed=rows).reshape(-1)
    matrix = QuantizedLinear.from_rows(split_rows(raw, type_id, (rows, cols)))
    expected = matrix.dequantize(torch.float32)
    graph = graph_matrix(matrix)
    assert graph.format.wide == (fmt.bits not in (4, 8)) and graph.format.block_values == (
        fmt.block_values if fmt.block_values != fmt.group_size else 0)
    for start, stop, tile in graph.scratch_tiles(rows_per_tile=5):
        assert torch.equal(tile, expected[start:stop]), (start, stop)
    indices = torch.tensor([[0, rows - 1], [rows // 2, 3]])
    assert torch.equal(graph.dequantize_gathered(indices), expected[indices])


def test_one_projection_in_several_formats_shares_a_common_format_that_holds_each_exactly():
    """_common_matrices: Q4_K (a subtracted minimum), Q6_K and Q3_K (groups of 16, zero points), Q8_0 and
    Q5_1 (one scale a block) in one format: every tile equals each matrix's own dequantisation."""
    from edgetrain.export.mesp_program import _common_matrices
    from edgetrain.models.gguf.blocks import BLOCK_FORMATS
    from edgetrain.models.gguf.packed_rows import split_rows
    from edgetrain.models.quantized import QuantizedLinear
    from gguf_blocks_testkit import random_blocks

    rows, cols = 6, 512
    modules = []
    for seed, type_name in enumerate(["Q4_K", "Q6_K", "Q3_K", "Q8_0", "Q5_1"]):
        type_id = next(t for t, f in BLOCK_FORMATS.items() if f.name == type_name)
        fmt = BLOCK_FORMATS[type_id]
        raw = random_blocks(type_name, rows * cols // fmt.block_values, seed=seed).reshape(-1)
        modules.append(QuantizedLinear.from_rows(split_rows(raw, type_id, (rows, cols))))
    common = _common_matrices(modules)
    assert len({matrix_format for matrix_format, _ in common}) == 1
    assert common[0][0].group_size == 16 and common[0][0].wide
    for module, (matrix_format, parts) in zip(modules, common):
        graph = matrix_from_inputs(matrix_format, iter(parts))
        expected = module.dequantize(torch.float32)
        for start, stop, tile in graph.scratch_tiles(rows_per_tile=4):
            assert torch.equal(tile, expected[start:stop]), module.layout.format_name
