"""Damaged checkpoints and configs: every failure is a clean EdgetrainError, never a crash or a hang."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import edgetrain
from edgetrain.checkpoint import atomic_save_safetensors, load_safetensors_checked
from edgetrain.models.llama import LlamaConfig, LlamaModel

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    """A small Qwen2-style checkpoint written in the Hugging Face layout."""
    from safetensors.torch import save_file

    from edgetrain.models.llama import edgetrain_key_to_hf

    directory = tmp_path_factory.mktemp("ckpt")
    config = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                         tie_word_embeddings=True, model_type="qwen2")
    model = LlamaModel(config)
    model.init_weights()
    state = {edgetrain_key_to_hf(k): v.contiguous() for k, v in model.state_dict().items()
             if k != "head.lm_head.weight"}
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "vocab_size": 50, "hidden_size": 16, "intermediate_size": 24,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "tie_word_embeddings": True}))
    return directory


def _copy(source, tmp_path, name):
    target = tmp_path / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)
    return target


def test_pristine_checkpoint_loads(checkpoint_dir):
    assert edgetrain.load_model(checkpoint_dir)(torch.zeros(1, 3, dtype=torch.long)).shape == (1, 3, 50)


@FUZZ
@given(data=st.data())
def test_corrupted_weights_file(checkpoint_dir, tmp_path, data):
    directory = _copy(checkpoint_dir, tmp_path, "corrupt")
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
    try:
        model = edgetrain.load_model(directory)
    except edgetrain.EdgetrainError:
        return
    # A flip inside tensor data is not detectable without a checksum (HF files carry none): the model
    # still loads with the right structure.
    assert isinstance(model, LlamaModel)


@FUZZ
@given(config=st.dictionaries(
    st.sampled_from(["model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                     "tie_word_embeddings", "rope_scaling", "attention_bias"]),
    st.one_of(st.integers(-5, 1 << 40), st.floats(allow_nan=True), st.text(max_size=5), st.none(),
              st.booleans(), st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))))
def test_hostile_config_json(checkpoint_dir, tmp_path, config):
    directory = _copy(checkpoint_dir, tmp_path, "config")
    base = json.loads((directory / "config.json").read_text())
    base.update(config)
    (directory / "config.json").write_text(json.dumps(base))
    try:
        model = edgetrain.load_model(directory)
    except edgetrain.EdgetrainError:
        return
    assert isinstance(model, LlamaModel)


@FUZZ
@given(text=st.one_of(st.text(max_size=200), st.binary(max_size=200).map(lambda b: b.decode("latin-1"))))
def test_config_json_that_is_not_json(checkpoint_dir, tmp_path, text):
    directory = _copy(checkpoint_dir, tmp_path, "text")
    (directory / "config.json").write_text(text, encoding="utf-8", errors="surrogateescape")
    # No text of this size is a complete model config: each one is refused, and the error names the file.
    with pytest.raises(edgetrain.EdgetrainError, match="config"):
        edgetrain.load_model(directory)


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
    try:
        loaded, metadata = load_safetensors_checked(path)
    except edgetrain.EdgetrainError:
        return
    # The checksum covers the tensors and every metadata value: only a flip that leaves the header's
    # meaning unchanged (its space padding turned into other whitespace) can load, and then all is intact.
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items()) and metadata == written


def test_pickle_only_checkpoint_is_refused(checkpoint_dir, tmp_path):
    directory = _copy(checkpoint_dir, tmp_path, "pickle")
    (directory / "model.safetensors").unlink()
    (directory / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(edgetrain.EdgetrainError, match="safetensors only"):
        edgetrain.load_model(directory)


def test_shard_index_cannot_escape_directory(checkpoint_dir, tmp_path):
    directory = _copy(checkpoint_dir, tmp_path, "escape")
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../../etc/passwd"}}))
    with pytest.raises(edgetrain.EdgetrainError, match="not a plain file name"):
        edgetrain.load_model(directory)
