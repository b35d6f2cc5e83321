"""Damaged checkpoints and configs: every failure is a clean EdgetrainError, never a crash or a hang."""
from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import edgetrain
from edgetrain.training.checkpoint import atomic_save_safetensors, load_safetensors_checked
from edgetrain.models.llama import LlamaModel
from fault_tally import attempt, fuzz_settings, refused

FUZZ = fuzz_settings(60)


def test_pristine_checkpoint_loads(checkpoint_dir):
    assert edgetrain.load_model(checkpoint_dir)(torch.zeros(1, 3, dtype=torch.long)).shape == (1, 3, 50)


@FUZZ
@given(data=st.data())
def test_corrupted_weights_file(copy_checkpoint, data):
    directory = copy_checkpoint("corrupt")
    weights = directory / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    mode = data.draw(st.sampled_from(["truncate", "flip-header", "flip-anywhere", "garbage"]))
    if mode == "truncate":
        raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
    elif mode == "flip-header":
        header_len = int.from_bytes(raw[:8], "little")
        for position in data.draw(st.lists(st.integers(0, min(header_len + 7, len(raw) - 1)), min_size=1, max_size=8)):
            raw[position] = data.draw(st.integers(0, 255))
    elif mode == "flip-anywhere":
        for position in data.draw(st.lists(st.integers(0, len(raw) - 1), min_size=1, max_size=8)):
            raw[position] ^= data.draw(st.integers(1, 255))
    else:
        raw = bytearray(data.draw(st.binary(max_size=2048)))
    weights.write_bytes(bytes(raw))
    # A flip inside tensor data is not detectable without a checksum (HF files carry none): the model
    # still loads with the right structure.
    attempt("hostile model files", lambda: edgetrain.load_model(directory),
            sound=lambda model: isinstance(model, LlamaModel))


@FUZZ
@given(config=st.dictionaries(
    st.sampled_from(["model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                     "tie_word_embeddings", "rope_scaling", "attention_bias"]),
    st.one_of(st.integers(-5, 1 << 40), st.floats(allow_nan=True), st.text(max_size=5), st.none(),
              st.booleans(), st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))))
def test_hostile_config_json(copy_checkpoint, config):
    directory = copy_checkpoint("config")
    base = json.loads((directory / "config.json").read_text())
    base.update(config)
    (directory / "config.json").write_text(json.dumps(base))

    def as_written(model) -> bool:
        # Accepted only as the file says it: no value coerced (a string "false" taken as true), none dropped.
        for key, value in base.items():
            # (Qwen2 has q/k/v bias whatever attention_bias says, as in transformers.)
            if key in ("model_type", "rope_scaling", "attention_bias") or value is None:
                continue
            loaded = getattr(model.config, key)
            if type(loaded) is not type(value) and not (isinstance(loaded, float) and type(value) is int):
                return False
            if loaded != value and not (isinstance(value, float) and math.isnan(value)):
                return False
        return isinstance(model, LlamaModel)

    attempt("hostile model files", lambda: edgetrain.load_model(directory), sound=as_written)


@FUZZ
@given(text=st.one_of(st.text(max_size=200), st.binary(max_size=200).map(lambda b: b.decode("latin-1"))))
def test_config_json_that_is_not_json(copy_checkpoint, text):
    directory = copy_checkpoint("text")
    (directory / "config.json").write_text(text, encoding="utf-8", errors="surrogateescape")
    # No text of this size is a complete model config: each one is refused, and the error names the file.
    refused("hostile model files", lambda: edgetrain.load_model(directory), match="config")


@FUZZ
@given(data=st.data())
def test_damaged_learner_checkpoint_is_detected(tmp_path, data):
    tensors = {"a": torch.arange(64, dtype=torch.float32), "b": torch.ones(3, 5)}
    # A learner-like state: metadata as large as the tensors, so that flips land in it often.
    state = json.dumps({"steps_done": 1234, "stream_position": 5678, "lr": 0.00125, "seeds": list(range(40))})
    path = atomic_save_safetensors(tensors, tmp_path / "state.safetensors", {"note": "x", "state": state})
    _, written = load_safetensors_checked(path)
    raw = bytearray(path.read_bytes())
    position = data.draw(st.integers(0, len(raw) - 1))
    raw[position] ^= data.draw(st.integers(1, 255))
    path.write_bytes(bytes(raw))
    # The checksum covers the tensors and every metadata value: only a flip that leaves the header's
    # meaning unchanged (its space padding turned into other whitespace) can load, and then all is intact.
    attempt("checkpoint metadata", lambda: load_safetensors_checked(path),
            sound=lambda result: all(torch.equal(result[0][k], v) for k, v in tensors.items()) and result[1] == written)


def test_pickle_only_checkpoint_is_refused(copy_checkpoint):
    directory = copy_checkpoint("pickle")
    (directory / "model.safetensors").unlink()
    (directory / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(edgetrain.EdgetrainError, match="safetensors only"):
        edgetrain.load_model(directory)


def test_shard_index_cannot_escape_directory(copy_checkpoint):
    directory = copy_checkpoint("escape")
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../../etc/passwd"}}))
    with pytest.raises(edgetrain.EdgetrainError, match="not a plain file name"):
        edgetrain.load_model(directory)
