"""Gemma 3 (text): the decoder of edgetrain.models.llama with Gemma's features switched on -- RMSNorm
weights that act as 1 + w, norms after attention and after the MLP as well as before (sandwich norms), a
GeGLU MLP (tanh GELU), token embeddings scaled by sqrt(hidden), head norms over q and k, sliding-window layers
interleaved with global ones (five to one), each kind with its own RoPE base, attention scores scaled by
query_pre_attn_scalar, and a final logit soft-cap where the config has one.

1 + w: the model holds the norm weights as the factor they multiply by (1 + w), so one RMSNorm serves every
architecture. llama.cpp's converter writes them so into a GGUF already; from a checkpoint directory the
loader adds 1 (`norm_offset`), and a merged checkpoint subtracts it again -- exactly, since 1 + w - 1 is
exact in float32 for |w| < 1 and a later load adds the same 1 back.

Checkpoints name the model `gemma3_text` (Gemma3ForCausalLM: Gemma-3-270M, Gemma-3-1B); GGUF files `gemma3`.
The multimodal checkpoints (4B and up, model_type `gemma3`) nest the text model in `text_config`: not read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from edgetrain.models.decoder_registry import DecoderArchitecture, register_decoder
from edgetrain.models.llama import ConfigError, LlamaConfig

SLIDING_WINDOW_PATTERN = 6  # every sixth layer is global, the others slide (llama.cpp's default for gemma3)
LOCAL_ROPE_BASE = 10000.0  # the sliding layers' RoPE base (llama.cpp's default for gemma3)
GGUF_27B_LAYERS = 62  # llama.cpp scales Gemma-3-27B's scores by hidden / heads, every other size by head_dim


def layer_types_of(layers: int, pattern: int = SLIDING_WINDOW_PATTERN) -> list[str]:
    return ["full_attention" if (layer + 1) % pattern == 0 else "sliding_attention" for layer in range(layers)]


@dataclass
class Gemma3Config(LlamaConfig):
    head_dim: int | None = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    tie_word_embeddings: bool = True
    qk_norm: bool = True
    hidden_activation: str = "gelu_pytorch_tanh"
    sandwich_norms: bool = True
    scale_embeddings: bool = True
    query_pre_attn_scalar: float | None = 256
    sliding_window: int | None = 512
    rope_local_base_freq: float | None = LOCAL_ROPE_BASE
    model_type: str = "gemma3_text"

    def __post_init__(self) -> None:
        if self.layer_types is None and isinstance(self.num_hidden_layers, int) and 0 < self.num_hidden_layers <= 1024:
            self.layer_types = layer_types_of(self.num_hidden_layers)
        super().__post_init__()

    @classmethod
    def hf_values(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """transformers 5 nests the two RoPE bases in rope_parameters by layer type; 4.x names them
        rope_theta and rope_local_base_freq, and the layer pattern sliding_window_pattern."""
        if raw.get("attn_logit_softcapping") is not None:
            raise ConfigError("config.json attn_logit_softcapping: attention logit soft-capping (Gemma 2) is not "
                              "supported; Gemma 3 has none")
        if raw.get("use_bidirectional_attention"):
            raise ConfigError("config.json use_bidirectional_attention: only causal (generative) Gemma 3 is supported")
        nested = raw.get("rope_parameters")
        if isinstance(nested, dict) and isinstance(nested.get("full_attention"), dict):
            full, sliding = nested["full_attention"], nested.get("sliding_attention") or {}
            raw = {**raw, "rope_parameters": full,
                   "rope_local_base_freq": sliding.get("rope_theta", raw.get("rope_local_base_freq"))}
            if sliding.get("rope_type", "default") != "default":
                raise ConfigError(f"config.json rope_parameters.sliding_attention: rope_type "
                                  f"{sliding.get('rope_type')!r} is not supported for sliding layers")
        values = super().hf_values(raw)
        pattern = raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", SLIDING_WINDOW_PATTERN))
        if "layer_types" not in values and isinstance(pattern, int) and pattern > 0 \
                and isinstance(values.get("num_hidden_layers"), int) and 0 < values["num_hidden_layers"] <= 1024:
            values["layer_types"] = layer_types_of(values["num_hidden_layers"], pattern)
        return values


def _gguf_layer_types(pattern: Any, layers: int) -> Any:
    """llama.cpp's attention.sliding_window_pattern: one flag per layer (true: sliding), or every n-th layer
    global; anything else is passed on for the config's check to name."""
    if isinstance(pattern, (list, tuple)) or hasattr(pattern, "tolist"):
        flags = list(pattern.tolist() if hasattr(pattern, "tolist") else pattern)
        return ["sliding_attention" if flag else "full_attention" for flag in flags]
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        return layer_types_of(layers, pattern)
    return pattern


def gguf_fields(read: Callable[[str, Any], Any], layers: int, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    """The Gemma 3 fields a GGUF holds, with llama.cpp's defaults where it holds none (its gemma3 loader):
    `read(key, default)` reads `gemma3.{key}`. Without a sliding window every layer is global."""
    window = read("attention.sliding_window", 0)
    if not window:
        return {"layer_types": ["full_attention"] * layers, "sliding_window": None, "query_pre_attn_scalar": head_dim,
                "final_logit_softcapping": read("final_logit_softcapping", None) or None}
    # llama.cpp scales Gemma-3-27B's scores by hidden // heads (as Google's code does), every other one's by head_dim.
    scalar = hidden // heads if layers == GGUF_27B_LAYERS else head_dim
    return {"sliding_window": window,
            "layer_types": _gguf_layer_types(read("attention.sliding_window_pattern", SLIDING_WINDOW_PATTERN), layers),
            "rope_local_base_freq": read("rope.freq_base_swa", LOCAL_ROPE_BASE), "query_pre_attn_scalar": scalar,
            "final_logit_softcapping": read("final_logit_softcapping", None) or None}


GEMMA3 = register_decoder(DecoderArchitecture(
    "gemma3_text", Gemma3Config, "Gemma3ForCausalLM", gguf_name="gemma3", norm_offset=1.0,
    gguf_block_tensors={"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                        "post_ffw_norm": "post_feedforward_layernorm"},
    gguf_fields=gguf_fields))
