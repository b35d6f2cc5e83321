"""The table of ggml block formats (edgetrain.models.gguf.blocks): every format dequantises to gguf-py's
numpy reference (ggml's arithmetic) bit for bit, on random blocks whose f16 scales include the extremes
(largest, subnormal, zero, negative), and every field of a block is read from its own bytes."""
from __future__ import annotations

import numpy as np
import pytest

from edgetrain.models.gguf.blocks import BLOCK_FORMATS
from edgetrain.models.gguf.dequant import SUPPORTED_TYPE_NAMES, dequantize
from edgetrain.models.gguf.ggml_types import GGML_TYPES

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

from gguf_blocks_testkit import F16_FIELDS, random_blocks  # noqa: E402

@pytest.mark.parametrize("type_id", sorted(BLOCK_FORMATS), ids=lambda t: BLOCK_FORMATS[t].name)
def test_every_format_dequantises_bit_for_bit_as_gguf_py(type_id):
    fmt = BLOCK_FORMATS[type_id]
    assert GGML_TYPES[type_id][1:] == (fmt.block_values, fmt.block_bytes)  # the two tables agree
    raw = random_blocks(fmt.name, 64, seed=type_id)
    ours = dequantize(raw.reshape(-1), type_id, (64 * fmt.block_values,))
    with np.errstate(all="ignore"):
        reference = quants.dequantize(raw.reshape(-1), gguf.GGMLQuantizationType(type_id)).astype(np.float32)
    assert np.isfinite(ours).all()
    # Bits, not values: signed zeros count.
    np.testing.assert_array_equal(ours.view(np.uint32), reference.reshape(-1).view(np.uint32))


@pytest.mark.parametrize("type_id", sorted(BLOCK_FORMATS), ids=lambda t: BLOCK_FORMATS[t].name)
def test_every_byte_of_a_block_matters(type_id):
    """Flipping any one bit of a block changes its values (the split reads every field), except where the
    format leaves a bit without effect on this block's values: none do, once scales are nonzero."""
    fmt = BLOCK_FORMATS[type_id]
    raw = random_blocks(fmt.name, 1, seed=1)
    for offset in F16_FIELDS[fmt.name]:  # ordinary, nonzero scales: a zero scale hides its codes
        raw[0, offset:offset + 2] = np.array([0.5], dtype="<f2").view(np.uint8)
    if fmt.name == "Q4_K" or fmt.name == "Q5_K":
        raw[0, 4:16] = 0x41  # every 6-bit scale and minimum nonzero
    if fmt.name == "Q2_K":
        raw[0, 0:16] = 0x33
    if fmt.name == "Q3_K":
        raw[0, 96:108] = 0x11
    if fmt.name == "Q6_K":
        raw[0, 192:208] = 5
    if fmt.name == "IQ4_XS":
        raw[0, 2:4], raw[0, 4:8] = 0, 0x11  # every step 1 - 32
    base = fmt.dequantize(raw)
    for byte in range(fmt.block_bytes):
        for bit in range(8):
            flipped = raw.copy()
            flipped[0, byte] ^= np.uint8(1 << bit)
            with np.errstate(all="ignore"):
                changed = fmt.dequantize(flipped)
            assert not np.array_equal(changed, base, equal_nan=True), (fmt.name, byte, bit)


def test_the_supported_list_names_every_format():
    assert set(SUPPORTED_TYPE_NAMES) == {"F32", "F16", "BF16"} | {f.name for f in BLOCK_FORMATS.values()}


@pytest.mark.parametrize("type_id", sorted(BLOCK_FORMATS), ids=lambda t: BLOCK_FORMATS[t].name)
def test_the_torch_row_layout_holds_the_same_values_at_about_the_files_bytes(type_id):
    """packed_rows: the planes and steps torch's PackedMatrix holds give the file's values bit for bit, the
    same split whole or a few rows at a time, and cost at most one byte a group more than the file."""
    from edgetrain.models.gguf import packed_rows

    fmt = BLOCK_FORMATS[type_id]
    rows, cols = 6, 2 * 256
    raw = random_blocks(fmt.name, rows * cols // fmt.block_values, seed=type_id + 100).reshape(-1)
    whole = packed_rows.split_rows(raw, type_id, (rows, cols))
    saved, packed_rows.SPLIT_ROWS = packed_rows.SPLIT_ROWS, 4
    try:
        sliced = packed_rows.split_rows(raw, type_id, (rows, cols))
    finally:
        packed_rows.SPLIT_ROWS = saved
    expected = dequantize(raw, type_id, (rows, cols))
    for packed in (whole, sliced):
        assert packed.shape == (rows, cols)
        np.testing.assert_array_equal(packed_rows.dequantize_rows(packed).view(np.uint32), expected.view(np.uint32))
    order = np.array([3, 0, 5, 1, 4, 2])
    np.testing.assert_array_equal(packed_rows.dequantize_rows(whole.rows(order)), expected[order])
    assert whole.nbytes() <= raw.nbytes + rows * cols // fmt.group_size
