"""LoadOptions: one dataclass says how a base is held; bad values are named errors; load_model reads it, a
GGUF's 4- and 8-bit matrices stay packed by default, and the packed base computes the dequantised one's logits."""
from __future__ import annotations

import argparse
import logging

import pytest
import torch

import edgetrain
from edgetrain.backends.load_options import LoadOptions, LoadOptionsError, add_load_flags
from edgetrain.models.quantized import PackedMatrix, TiedQuantizedHead, packed_matrix_count


@pytest.mark.parametrize("fields, message", [
    ({"dequantize": "yes"}, "dequantize must be True or False"),
    ({"dequantize": 1}, "dequantize must be True or False"),
    ({"quantize_bits": 5}, "quantize_bits must be one of"),
    ({"quantize_bits": True}, "quantize_bits must be one of"),
    ({"quantize_bits": 4.0}, "quantize_bits must be one of"),
    ({"quantize_bits": "4"}, "quantize_bits must be one of"),
    ({"dtype": "float8"}, "unknown dtype"),
    ({"dtype": 32}, "unknown dtype"),
])
def test_bad_options_are_named_errors(fields, message):
    with pytest.raises(LoadOptionsError, match=message):
        LoadOptions(**fields)


def test_one_spelling_of_each_dtype_so_that_records_compare_equal():
    assert LoadOptions(dtype="bf16") == LoadOptions(dtype=torch.bfloat16) == LoadOptions(dtype="bfloat16")
    assert LoadOptions.of(torch.float32, None, None) == LoadOptions()
    assert LoadOptions.of(None, False, 8) == LoadOptions(dequantize=True, quantize_bits=8)
    assert LoadOptions.of(None, True, None) == LoadOptions()  # packed is the default
    with pytest.raises(LoadOptionsError, match="quantized must be"):
        LoadOptions.of(None, "no", None)


@pytest.mark.parametrize("record", [
    [1, 2], {"dequantize": False, "extra": 1}, {"quantize_bits": 7}, {"dtype": "int8"}, "packed",
])
def test_a_damaged_record_is_refused_naming_where_it_came_from(record):
    with pytest.raises(LoadOptionsError, match="store /s"):
        LoadOptions.from_record(record, "store /s")


def test_records_round_trip_and_a_missing_one_is_the_default():
    options = LoadOptions(dequantize=True, quantize_bits=4, dtype="bfloat16")
    assert LoadOptions.from_record(options.to_record(), "x") == options
    assert LoadOptions.from_record(None, "x") == LoadOptions()


def test_the_flags_build_the_options():
    parser = argparse.ArgumentParser()
    add_load_flags(parser)
    assert LoadOptions.from_args(parser.parse_args([])) == LoadOptions()
    assert LoadOptions.from_args(parser.parse_args(["--dequantize", "--quantize-bits", "8", "--dtype", "bf16"])) \
        == LoadOptions(dequantize=True, quantize_bits=8, dtype="bfloat16")
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantize-bits", "5"])
    lazy = argparse.ArgumentParser()
    add_load_flags(lazy, dtype_default=None)
    assert LoadOptions.asked_for(lazy.parse_args([])) is None  # nothing asked: a store keeps its own
    assert LoadOptions.asked_for(lazy.parse_args(["--dequantize"])) == LoadOptions(dequantize=True)


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("tie", [False, True])
def test_a_gguf_is_kept_packed_by_default_and_computes_the_dequantised_logits(tmp_path, ggml_type, tie):
    from gguf_testkit import Q, hf_model, write_gguf

    path = write_gguf(tmp_path / "model.gguf", hf_model("llama", tie=tie), getattr(Q, ggml_type))
    packed = edgetrain.load_model(path)
    dense = edgetrain.load_model(path, options=LoadOptions(dequantize=True))
    blocks = len(packed.blocks)
    # 7 projections a block, the embedding, and an untied head: all as the file stores them
    assert packed_matrix_count(packed) == 7 * blocks + 1 + (0 if tie else 1)
    assert isinstance(packed.head.lm_head, TiedQuantizedHead if tie else PackedMatrix)
    assert packed_matrix_count(dense) == 0
    tokens = torch.randint(0, packed.config.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.equal(packed(tokens), dense(tokens))  # each tile dequantised to the same fp32 values


def test_quantize_bits_packs_what_is_dense_and_leaves_the_packed_as_stored(tmp_path):
    from gguf_testkit import Q, hf_model, write_gguf

    path = write_gguf(tmp_path / "model.gguf", hf_model("llama"), Q.Q8_0)
    kept = edgetrain.load_model(path, quantize_bits=4)
    assert {m.bits for m in kept.modules() if isinstance(m, PackedMatrix)} == {8}  # not requantised
    requantised = edgetrain.load_model(path, options=LoadOptions(dequantize=True, quantize_bits=4))
    assert {m.bits for m in requantised.modules() if isinstance(m, PackedMatrix)} == {4}
    preset = edgetrain.load_model("tiny", options=LoadOptions(quantize_bits=8))
    assert packed_matrix_count(preset) == 7 * len(preset.blocks) + 1  # tiny's head is tied to its embedding


def test_a_float_matrix_is_held_dense_and_said_so_only_for_quantised_types(tmp_path, caplog):
    """An F16 file holds nothing to keep packed: dense, and no "dequantised" line (nothing was)."""
    from gguf_testkit import Q, hf_model, write_gguf

    path = write_gguf(tmp_path / "model.gguf", hf_model("llama"), Q.F16)
    with caplog.at_level(logging.INFO, logger="edgetrain"):
        model = edgetrain.load_model(path)
    assert packed_matrix_count(model) == 0
    assert "dequantised" not in caplog.text


def test_a_type_edgetrain_does_not_read_is_refused_by_name(tmp_path):
    """A type edgetrain does not read (Q8_1 here, llama.cpp's activation type; the i-quants other than
    IQ4_NL/IQ4_XS too) is refused by name on the packed and the dense path alike, never guessed at."""
    import numpy as np
    from gguf_testkit import Q, hf_model, write_gguf
    from edgetrain.models.gguf import GGUFError

    def q8_1(writer):
        name = "blk.0.ffn_up.weight"
        rows, cols = tuple(writer.tensors[0].pop(name).shape)
        writer.add_tensor(name, np.zeros((rows, cols // 32 * 40), np.uint8), raw_dtype=Q.Q8_1)

    path = write_gguf(tmp_path / "model.gguf", hf_model("llama"), Q.Q4_0, tweak=q8_1)
    for options in (LoadOptions(), LoadOptions(dequantize=True)):
        with pytest.raises(GGUFError, match="blk.0.ffn_up.weight.*Q8_1"):
            edgetrain.load_model(path, options=options)
