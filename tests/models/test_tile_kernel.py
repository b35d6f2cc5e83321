"""The compiled tile kernel (edgetrain/models/_tile_kernel.c): every layout a packed matrix holds dequantises
through it bit for bit as through the torch kernels and as gguf-py's reference, whole, in tiles, and by
gathered rows; tensors it cannot take go to the torch path untouched."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from edgetrain.models import tile_kernel
from edgetrain.models.gguf import packed_rows
from edgetrain.models.gguf.blocks import BLOCK_FORMATS
from edgetrain.models.gguf.dequant import dequantize
from edgetrain.models.quantized import PackedMatrix, QuantizedLinear

from gguf_blocks_testkit import random_blocks


def test_the_kernel_is_built_where_the_suite_runs():
    """The suite's install builds it (pyproject's ext-modules): without it every comparison below would compare
    the torch path with itself."""
    assert tile_kernel._tile_kernel is not None, tile_kernel.status()
    assert tile_kernel.available()


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int32)


def _matrix(type_id: int, rows: int, cols: int, seed: int) -> QuantizedLinear:
    fmt = BLOCK_FORMATS[type_id]
    raw = random_blocks(fmt.name, rows * cols // fmt.block_values, seed=seed).reshape(-1)
    return QuantizedLinear.from_rows(packed_rows.split_rows(raw, type_id, (rows, cols)))


def _reference(type_id: int, rows: int, cols: int, seed: int) -> np.ndarray:
    fmt = BLOCK_FORMATS[type_id]
    raw = random_blocks(fmt.name, rows * cols // fmt.block_values, seed=seed).reshape(-1)
    return dequantize(raw, type_id, (rows, cols))


@pytest.mark.parametrize("type_id", sorted(BLOCK_FORMATS), ids=lambda t: BLOCK_FORMATS[t].name)
def test_every_gguf_format_dequantises_as_the_torch_kernels_and_the_file(type_id):
    rows, cols = 7, 512
    layer = _matrix(type_id, rows, cols, seed=type_id + 7)
    with tile_kernel.kernel_enabled(False):
        torch_path = layer.dequantize()
    compiled = layer.dequantize()
    assert torch.equal(_bits(compiled), _bits(torch_path))
    reference = _reference(type_id, rows, cols, seed=type_id + 7)
    np.testing.assert_array_equal(compiled.numpy().view(np.uint32), reference.view(np.uint32))


@pytest.mark.parametrize("type_id", sorted(BLOCK_FORMATS), ids=lambda t: BLOCK_FORMATS[t].name)
def test_tiles_and_gathered_rows_agree_with_the_whole(type_id):
    rows, cols = 9, 256
    layer = _matrix(type_id, rows, cols, seed=type_id + 11)
    whole = layer.dequantize().clone()
    tiles = [tile.clone() for _, _, tile in layer.scratch_tiles(rows_per_tile=4)]
    assert torch.equal(_bits(torch.cat(tiles)), _bits(whole))
    picked = torch.tensor([[8, 0, 3], [3, 3, 5]])
    assert torch.equal(_bits(layer.dequantize_gathered(picked)), _bits(whole[picked]))


@pytest.mark.parametrize("bits", [4, 8])
def test_matrices_quantised_on_load_dequantise_as_the_torch_kernels(bits):
    generator = torch.Generator().manual_seed(bits)
    weight = torch.randn(33, 96, generator=generator) * torch.logspace(-4, 3, 33).unsqueeze(1)
    layer = QuantizedLinear.from_dense(weight, bits)
    with tile_kernel.kernel_enabled(False):
        torch_path = layer.dequantize()
    assert torch.equal(_bits(layer.dequantize()), _bits(torch_path))


def test_float32_scales_beyond_float16_and_float64_models_take_their_own_paths():
    """Scales float16 cannot hold stay float32 (the kernel takes them); a float64 model dequantises in
    float64 (the torch path): both equal the torch path."""
    weight = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 1e6
    layer = QuantizedLinear.from_dense(weight, 4)
    assert layer.scales.dtype == torch.float32
    with tile_kernel.kernel_enabled(False):
        expected = layer.dequantize()
    assert torch.equal(_bits(layer.dequantize()), _bits(expected))
    double = _matrix(14, 3, 256, seed=3).double()  # Q6_K
    with tile_kernel.kernel_enabled(False):
        expected64 = double.dequantize()
    assert expected64.dtype == torch.float64 and torch.equal(double.dequantize(), expected64)


def test_tensors_the_kernel_cannot_take_are_left_untouched():
    out = torch.full((2, 64), 7.0)
    codes = torch.zeros(2, 32, dtype=torch.uint8)
    scales = torch.ones(2, 2)
    refusals = {
        "float64 out": dict(out=out.double()),
        "strided codes": dict(codes=torch.zeros(2, 64, dtype=torch.uint8)[:, ::2]),
        "codes of another width": dict(codes=torch.zeros(2, 31, dtype=torch.uint8)),
        "float64 scales": dict(scales=scales.double()),
        "several groups a scale without steps": dict(scales=torch.ones(2, 1)),
        "scales of another shape": dict(scales=torch.ones(2, 3)),
        "3-bit low plane": dict(low_bits=3),
        "a high plane missing": dict(high_bits=1),
        "groups that do not divide the row": dict(group_size=48),
        "a codebook with a bias": dict(codebook=torch.zeros(16), biases=torch.zeros(2, 2)),
        "biases of another dtype than the scales": dict(biases=torch.zeros(2, 2, dtype=torch.float16)),
        "steps of the wrong type": dict(scales=torch.ones(2, 1), scale_steps=torch.ones(2, 2)),
        "bias steps without biases": dict(bias_steps=torch.ones(2, 2, dtype=torch.uint8)),
    }
    base = dict(out=out, codes=codes, low_bits=4, high_codes=None, high_bits=0, group_size=32, offset=0,
                scales=scales, scale_steps=None, biases=None, bias_steps=None, subtracts_bias=False, codebook=None)
    for what, change in refusals.items():
        arguments = {**base, **change}
        assert not tile_kernel.dequantize_rows(**arguments), what
        assert bool((arguments["out"] == 7.0).all()), what
    assert tile_kernel.dequantize_rows(**base) and bool((out == 0.0).all())


def test_the_switch_turns_the_kernel_off(monkeypatch):
    with tile_kernel.kernel_enabled(False):
        assert not tile_kernel.available()
        assert "off" in tile_kernel.status()
    assert tile_kernel.available()
    assert "compiled" in tile_kernel.status()


def test_a_packed_matrix_shell_on_the_meta_device_is_not_sent_to_the_kernel():
    shell = PackedMatrix(4, 64, 4, device="meta")
    dense = torch.empty(4, 64, device="meta")
    assert not shell._dequantize_compiled(shell._packed_rows(slice(0, 4)), dense)


def test_the_build_shares_a_tiles_rows_among_threads_where_the_compiler_has_openmp():
    """setup.py builds with OpenMP first (gcc has it): the rows are then split among torch's threads."""
    import shutil
    import sys

    if not (sys.platform.startswith("linux") and shutil.which("gcc")):
        pytest.skip("the OpenMP build is checked where gcc builds the kernel")
    assert tile_kernel._tile_kernel.parallel(), tile_kernel.status()
    assert "shared among torch's threads" in tile_kernel.status()


@pytest.mark.parametrize("type_id", sorted(BLOCK_FORMATS), ids=lambda t: BLOCK_FORMATS[t].name)
def test_every_thread_count_gives_the_same_bits(type_id):
    """Each thread takes a contiguous share of the rows: 1, 2 and 3 threads (a share of 4 rows and two of
    5) and more threads than rows all write what the torch kernels write."""
    layer = _matrix(type_id, 13, 256, seed=type_id + 3)
    with tile_kernel.kernel_enabled(False):
        expected = _bits(layer.dequantize())
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3, 16):
            torch.set_num_threads(threads)
            assert torch.equal(_bits(layer.dequantize()), expected), threads
            tiles = torch.cat([tile.clone() for _, _, tile in layer.scratch_tiles(rows_per_tile=6)])
            assert torch.equal(_bits(tiles), expected), threads
    finally:
        torch.set_num_threads(before)


def test_a_plan_fills_any_range_of_rows_and_refuses_an_output_that_does_not_fit():
    layer = _matrix(next(t for t in BLOCK_FORMATS if BLOCK_FORMATS[t].name == "Q6_K"), 9, 512, seed=5)
    whole = layer.dequantize()
    rows = layer._kernel_rows(None, None)
    assert rows is not None and (rows.rows, rows.cols) == (9, 512)
    out = torch.full((4, 512), 7.0)
    rows.fill(out, 3, 7)
    assert torch.equal(_bits(out), _bits(whole[3:7]))
    for start, stop, tensor in [(3, 8, out), (8, 12, out), (5, 3, out), (0, 4, out.double()), (0, 4, out.t())]:
        with pytest.raises(ValueError, match="do not fit"):
            rows.fill(tensor, start, stop)
    assert torch.equal(_bits(out), _bits(whole[3:7]))  # a refused fill writes nothing
    # A tile moved to another dtype or device, or a float64 model, takes the general path.
    assert layer._kernel_rows(torch.float64, None) is None and layer._kernel_rows(None, "meta") is None
