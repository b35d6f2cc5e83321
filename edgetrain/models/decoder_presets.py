"""Named decoder presets: published shapes of real models (random init, for profiling and benchmarks without
weights: Qwen2.5, Qwen3, Llama 3.2, Gemma 3) and `tiny`. DECODER_PRESETS maps each name to its config."""
from __future__ import annotations

from functools import partial
from typing import Callable

from edgetrain.models.decoders import architecture_names, config_from_hf_dict
from edgetrain.models.llama import LlamaConfig, LlamaModel
from edgetrain.models.gemma3 import Gemma3Config
from edgetrain.models.qwen3 import Qwen3Config
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


def qwen3_config(name: str) -> LlamaConfig:
    return Qwen3Config(vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                       max_position_embeddings=40960, **QWEN3_SHAPES[name])


def llama32_config(name: str) -> LlamaConfig:
    return LlamaConfig(vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
                       max_position_embeddings=131072, model_type="llama",
                       rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                       **LLAMA32_SHAPES[name])


def gemma3_config(name: str) -> LlamaConfig:
    return Gemma3Config(vocab_size=262144, max_position_embeddings=32768, **GEMMA3_SHAPES[name])


def tiny_config() -> LlamaConfig:
    """Small enough for tests and the default demo, but with every feature of the real shapes:
    GQA (4 query heads over 2 KV heads), q/k/v bias, tied embeddings, byte-level vocab."""
    return LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                       attention_bias=True, tie_word_embeddings=True, max_position_embeddings=2048,
                       model_type="qwen2")


# From the Qwen3 and Llama 3.2 config.json files published with the weights.
QWEN3_SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128),
}
LLAMA32_SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, head_dim=128),
}
GEMMA3_SHAPES = {  # from Gemma 3's config.json files (Gemma3ForCausalLM, text only)
    "gemma-3-270m": dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=256, sliding_window=512, query_pre_attn_scalar=256),
    "gemma-3-1b": dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                       num_key_value_heads=1, head_dim=256, sliding_window=512, query_pre_attn_scalar=256),
}
DECODER_PRESETS: dict[str, Callable[[], LlamaConfig]] = {
    "tiny": tiny_config,
    **{name: partial(qwen25_config, name) for name in QWEN25_SHAPES},
    **{name: partial(qwen3_config, name) for name in QWEN3_SHAPES},
    **{name: partial(llama32_config, name) for name in LLAMA32_SHAPES},
    **{name: partial(gemma3_config, name) for name in GEMMA3_SHAPES},
}


def preset_config(name: str) -> LlamaConfig | None:
    """The config of decoder preset `name`, or None when no preset has that name."""
    build = DECODER_PRESETS.get(name)
    return build() if build else None


def _build(config: LlamaConfig) -> LlamaModel:
    model = LlamaModel(config)
    model.init_weights()
    return model


for _name, _config in DECODER_PRESETS.items():
    MODEL_PRESETS.add(_name, partial(lambda config: _build(config()), _config))

for _model_type in architecture_names():
    ARCHITECTURES.add(_model_type, lambda raw: LlamaModel(config_from_hf_dict(raw)))
