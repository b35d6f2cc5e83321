"""Gemma 3 features the fixture does not carry, against transformers on checkpoints it saves: a final logit
soft-cap, linear RoPE scaling on the global layers (Gemma 3 at 4B and up), and transformers 4's flat config
keys (rope_theta, rope_local_base_freq, sliding_window_pattern) beside transformers 5's nested ones."""
from __future__ import annotations

import json

import pytest
import torch

import edgetrain
from testkit import move_norms_off_one
from edgetrain.models.llama import ConfigError

transformers = pytest.importorskip("transformers")


def gemma3_checkpoint(directory, **overrides):
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(**{**dict(
        vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=7, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=5, max_position_embeddings=64,
        initializer_range=0.2), **overrides})
    model = transformers.Gemma3ForCausalLM(config).eval()
    move_norms_off_one(model)
    model.save_pretrained(directory)
    return model


def _relative(model, reference) -> float:
    ids = torch.randint(0, 97, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
        return float((model(ids) - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("overrides", [
    dict(final_logit_softcapping=2.0),
    dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
], ids=["soft-cap", "linear-rope"])
def test_logits_equal_transformers(tmp_path, overrides):
    reference = gemma3_checkpoint(tmp_path, **overrides)
    model = edgetrain.load_model(tmp_path)
    assert model.config.model_type == "gemma3_text"
    assert _relative(model, reference) <= 1e-5


def test_transformers_4_flat_keys_give_the_same_model(tmp_path):
    reference = gemma3_checkpoint(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    nested = raw.pop("rope_parameters")
    raw.pop("layer_types")
    raw.update(rope_theta=nested["full_attention"]["rope_theta"],
               rope_local_base_freq=nested["sliding_attention"]["rope_theta"], sliding_window_pattern=6)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model = edgetrain.load_model(tmp_path)
    assert model.config.layer_types == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert _relative(model, reference) <= 1e-5


@pytest.mark.parametrize("field, value, said", [
    ("attn_logit_softcapping", 50.0, "attention logit soft-capping"),
    ("use_bidirectional_attention", True, "only causal"),
    ("layer_types", ["sliding_attention"] * 3, "one type for each of the 7 layers"),
    ("sliding_window", -1, "sliding layers need a window"),
])
def test_configs_it_cannot_build_are_refused_by_name(tmp_path, field, value, said):
    gemma3_checkpoint(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw[field] = value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=said):
        edgetrain.load_model(tmp_path)


def test_a_gguf_with_linear_rope_scaling_reads_it_and_other_types_are_refused(tmp_path):
    """llama.cpp's converter writes linear scaling as rope.scaling.type / rope.scaling.factor (Gemma 3 at 4B and
    up): read, it divides the global layers' frequencies by the factor; YaRN and others are refused by name."""
    import dataclasses

    from gguf_testkit import hf_model, write_gguf
    from edgetrain.models.gguf import GGUFError
    from edgetrain.models.llama import LlamaModel

    def scaled(kind):
        def tweak(writer):
            writer.add_string("llama.rope.scaling.type", kind)
            writer.add_float32("llama.rope.scaling.factor", 8.0)
        return tweak

    plain = edgetrain.load_model(write_gguf(tmp_path / "plain.gguf", hf_model("llama")))
    model = edgetrain.load_model(write_gguf(tmp_path / "linear.gguf", hf_model("llama"), tweak=scaled("linear")))
    assert model.config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    rebuilt = LlamaModel(dataclasses.replace(plain.config, rope_scaling={"rope_type": "linear", "factor": 8.0}))
    rebuilt.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 200, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids), rebuilt(ids)) and not torch.allclose(model(ids), plain(ids))
    with pytest.raises(GGUFError, match="rope.scaling.type = 'yarn': only linear"):
        edgetrain.load_model(write_gguf(tmp_path / "yarn.gguf", hf_model("llama"), tweak=scaled("yarn")))


@pytest.mark.parametrize("model_type, said", [("phi3", "LongRoPE"), ("smollm3", "no_rope_layers"),
                                              ("gemma3", "multimodal"), ("mistral", "builds the decoder")])
def test_architectures_not_built_are_refused_saying_what_they_lack(tmp_path, model_type, said):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": 64}))
    with pytest.raises(ConfigError, match=f"unsupported model_type '{model_type}'.*{said}"):
        edgetrain.load_model(tmp_path)


@pytest.mark.parametrize("arch, said", [("phi3", "LongRoPE"), ("smollm3", "no_rope_layers")])
def test_gguf_architectures_not_built_are_refused_saying_what_they_lack(tmp_path, arch, said):
    from gguf_testkit import hf_model, write_gguf
    from edgetrain.models.gguf import GGUFError

    def rename(writer):
        writer.kv_data[0]["general.architecture"].value = arch

    with pytest.raises(GGUFError, match=f"general.architecture '{arch}' is not supported.*{said}"):
        edgetrain.load_model(write_gguf(tmp_path / "model.gguf", hf_model("llama"), tweak=rename))
