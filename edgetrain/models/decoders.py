"""Every decoder architecture edgetrain builds, imported so that each registers itself, and the lookups the
loaders use: config.json (model_type) and GGUF (general.architecture) -> the architecture and its config."""
from __future__ import annotations

from typing import Any

from edgetrain.models import gemma3, llama, qwen3  # noqa: F401  (each registers its architecture)
from edgetrain.models.decoder_registry import DECODER_ARCHITECTURES, DecoderArchitecture
from edgetrain.models.llama import ConfigError, LlamaConfig
from edgetrain.registry import UnknownNameError


# Architectures people ask for that edgetrain does not build (config.json model_type or GGUF general.architecture),
# with what each would need: said by name instead of a bare "unsupported".
NOT_BUILT = {
    "phi3": "Phi-3 / Phi-4-mini fuse q/k/v and gate/up into single projections and scale RoPE with LongRoPE's "
            "short and long factors; edgetrain's decoder has neither",
    "smollm3": "SmolLM3 leaves RoPE out of every fourth layer (no_rope_layers); edgetrain's decoder rotates "
               "every layer",
    "gemma3": "this is a multimodal Gemma 3 checkpoint (text model nested in text_config); edgetrain reads the "
              "text-only gemma3_text checkpoints (Gemma-3-270M, Gemma-3-1B) and Gemma 3 GGUF files",
    "gemma2": "Gemma 2 soft-caps its attention logits; edgetrain builds Gemma 3",
    "qwen3_moe": "Qwen3's mixture-of-experts models route tokens to experts; edgetrain builds dense decoders",
}


def decoder_architecture(model_type: Any, where: str = "config.json") -> DecoderArchitecture:
    """The architecture named `model_type`; anything else is a ConfigError listing those edgetrain builds
    (and, for one it knows of, what it lacks)."""
    try:
        return DECODER_ARCHITECTURES.get(str(model_type))
    except UnknownNameError:
        why = f" ({NOT_BUILT[str(model_type)]})" if str(model_type) in NOT_BUILT else ""
        raise ConfigError(f"{where}: unsupported model_type {model_type!r}{why}; edgetrain builds the decoder "
                          f"architectures {', '.join(DECODER_ARCHITECTURES.names())}") from None


def architecture_names() -> list[str]:
    return DECODER_ARCHITECTURES.names()


def gguf_architectures() -> dict[str, DecoderArchitecture]:
    """GGUF general.architecture -> the architecture it names."""
    return {DECODER_ARCHITECTURES.get(name).gguf_architecture: DECODER_ARCHITECTURES.get(name)
            for name in DECODER_ARCHITECTURES.names()}


def config_from_hf_dict(raw: dict[str, Any], where: str = "config.json") -> LlamaConfig:
    """A config.json dict -> its architecture's config, the architecture's fixed features applied."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must hold a JSON object")
    architecture = decoder_architecture(raw.get("model_type"), where)
    values = architecture.config_class.hf_values(raw)
    # A fixed feature overrides what the file says, but a value of the wrong type (a JSON "false") stays, for the
    # config's own check to refuse by name: the file is damaged, whatever the architecture fixes.
    values.update({name: value for name, value in architecture.fixed.items()
                   if name not in values or isinstance(values[name], type(value))})
    values["model_type"] = architecture.model_type
    return architecture.config_class.from_values(values)


def architecture_of(config: LlamaConfig) -> DecoderArchitecture:
    return decoder_architecture(config.model_type, "model config")
