"""Every decoder architecture edgetrain builds, imported so that each registers itself, and the lookups the
loaders use: config.json (model_type) and GGUF (general.architecture) -> the architecture and its config."""
from __future__ import annotations

from typing import Any

from edgetrain.models import gemma3, llama, qwen3  # noqa: F401  (each registers its architecture)
from edgetrain.models.decoder_registry import DECODER_ARCHITECTURES, DecoderArchitecture
from edgetrain.models.llama import ConfigError, LlamaConfig
from edgetrain.registry import UnknownNameError


def decoder_architecture(model_type: Any, where: str = "config.json") -> DecoderArchitecture:
    """The architecture named `model_type`; anything else is a ConfigError listing those edgetrain builds."""
    try:
        return DECODER_ARCHITECTURES.get(str(model_type))
    except UnknownNameError:
        raise ConfigError(f"{where}: unsupported model_type {model_type!r}; edgetrain builds the decoder "
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
    values.update(architecture.fixed)
    values["model_type"] = architecture.model_type
    return architecture.config_class.from_values(values)


def architecture_of(config: LlamaConfig) -> DecoderArchitecture:
    return decoder_architecture(config.model_type, "model config")
