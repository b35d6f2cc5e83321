"""Named decoder presets: published Qwen2.5 shapes (random init, for profiling without weights) and `tiny`."""
from __future__ import annotations

from edgetrain.models.decoders import architecture_names, config_from_hf_dict
from edgetrain.models.llama import LlamaConfig, LlamaModel
from edgetrain.models.zoo import ARCHITECTURES, MODEL_PRESETS

# From the Qwen2.5 config.json files published with the weights.
QWEN25_SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2),
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2),
}


def qwen25_config(name: str) -> LlamaConfig:
    return LlamaConfig(vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=True,
                       tie_word_embeddings=True, max_position_embeddings=32768, model_type="qwen2",
                       **QWEN25_SHAPES[name])


def tiny_config() -> LlamaConfig:
    """Small enough for tests and the default demo, but with every feature of the real shapes:
    GQA (4 query heads over 2 KV heads), q/k/v bias, tied embeddings, byte-level vocab."""
    return LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                       attention_bias=True, tie_word_embeddings=True, max_position_embeddings=2048,
                       model_type="qwen2")


def _build(config: LlamaConfig) -> LlamaModel:
    model = LlamaModel(config)
    model.init_weights()
    return model


def _register_qwen(name: str) -> None:
    MODEL_PRESETS.add(name, lambda: _build(qwen25_config(name)))


for _name in QWEN25_SHAPES:
    _register_qwen(_name)

MODEL_PRESETS.add("tiny", lambda: _build(tiny_config()))

for _model_type in architecture_names():
    ARCHITECTURES.add(_model_type, lambda raw: LlamaModel(config_from_hf_dict(raw)))
