"""Decoder parity with transformers on checkpoints saved with save_pretrained, and loader errors."""
from __future__ import annotations

import json

import pytest
import torch

import edgetrain
from edgetrain.models import CheckpointError, ConfigError, LlamaConfig

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
             num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128)


def _save(model, path, **kwargs):
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


def _hf_qwen2(tie: bool):
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**SMALL, rope_theta=1e6, tie_word_embeddings=tie, rms_norm_eps=1e-6)
    return transformers.Qwen2ForCausalLM(config).eval()


def _hf_llama(**extra):
    torch.manual_seed(1)
    config = transformers.LlamaConfig(**SMALL, rope_theta=5e5, tie_word_embeddings=False, **extra)
    return transformers.LlamaForCausalLM(config).eval()


def _assert_same_logits(hf_model, ours, seq_len=20):
    torch.manual_seed(3)
    tokens = torch.randint(0, SMALL["vocab_size"], (2, seq_len))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tie", [True, False])
def test_qwen2_logits_match_transformers(tmp_path, tie):
    hf_model = _hf_qwen2(tie)
    ours = edgetrain.load_model(_save(hf_model, tmp_path))
    assert ours.config.attention_bias and ours.config.tie_word_embeddings == tie
    if tie:
        assert ours.head.lm_head.weight is ours.embed.embed_tokens.weight
    _assert_same_logits(hf_model, ours)


def test_llama_logits_match_transformers(tmp_path):
    hf_model = _hf_llama()
    ours = edgetrain.load_model(_save(hf_model, tmp_path))
    assert not ours.config.attention_bias
    _assert_same_logits(hf_model, ours)


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)
    hf_model = _hf_llama(rope_scaling=scaling)
    ours = edgetrain.load_model(_save(hf_model, tmp_path))
    assert ours.config.rope_scaling is not None
    _assert_same_logits(hf_model, ours, seq_len=40)


def test_sharded_checkpoint_loads(tmp_path):
    hf_model = _hf_qwen2(tie=False)
    _save(hf_model, tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    _assert_same_logits(hf_model, edgetrain.load_model(tmp_path))


def test_bf16_load(tmp_path):
    ours = edgetrain.load_model(_save(_hf_qwen2(tie=True), tmp_path), dtype="bf16")
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    assert ours(torch.randint(0, 97, (1, 8))).dtype == torch.bfloat16


def test_unsupported_model_type(tmp_path):
    path = _save(_hf_qwen2(tie=True), tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="unsupported model_type 'gpt2'"):
        edgetrain.load_model(path)


def test_missing_weights_file(tmp_path):
    path = _save(_hf_qwen2(tie=True), tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        edgetrain.load_model(path)


def test_shape_mismatch_names_the_tensor(tmp_path):
    path = _save(_hf_qwen2(tie=True), tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"mlp\.(gate|up|down)_proj\.weight' has shape"):
        edgetrain.load_model(path)


def test_missing_directory_and_unknown_preset(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist|not a checkpoint"):
        edgetrain.load_model(tmp_path / "nope")
    with pytest.raises(edgetrain.EdgetrainError, match="known presets: .*tiny"):
        edgetrain.load_model("qwen9-huge")


@pytest.mark.parametrize("field,value,message", [
    ("num_key_value_heads", 4, "must divide num_attention_heads"),
    ("hidden_size", -8, "must be in 1.."),
    ("vocab_size", "many", "must be an integer"),
    ("rms_norm_eps", 5.0, "must be in \\(0, 1\\)"),
])
def test_config_validation_names_the_field(field, value, message):
    raw = dict(SMALL, model_type="llama")
    raw[field] = value
    with pytest.raises(ConfigError, match=f"{field}.*{message}"):
        LlamaConfig.from_hf_dict(raw)


def test_presets_have_published_shapes():
    from edgetrain.models.decoder_presets import qwen25_config

    config = qwen25_config("qwen2.5-0.5b")
    with torch.device("meta"):
        model = edgetrain.models.LlamaModel(config)
    # Qwen2.5-0.5B: 494,032,768 parameters with the tied embedding counted once.
    assert sum(p.numel() for p in model.parameters()) == 494_032_768


@pytest.mark.parametrize("name, parameters, model_type", [
    ("qwen3-0.6b", 596_049_920, "qwen3"),     # Qwen3-0.6B's published count (tied embedding once)
    ("llama-3.2-1b", 1_235_814_400, "llama"),  # Llama-3.2-1B's
    ("gemma-3-270m", 268_098_176, "gemma3_text"),  # Gemma-3-270M's
    ("gemma-3-1b", 999_885_952, "gemma3_text"),    # Gemma-3-1B's
])
def test_todays_presets_have_published_shapes(name, parameters, model_type):
    from edgetrain.models.decoder_config import decoder_config

    config = decoder_config(name)
    with torch.device("meta"):
        model = edgetrain.models.LlamaModel(config)
    assert sum(p.numel() for p in model.parameters()) == parameters
    assert config.model_type == model_type
