"""Decoder architectures by name: what each loader, exporter and backend needs to know of one, so that
none of them branches on an architecture's name. One file per architecture (llama.py, qwen3.py) registers
its entry beside its config dataclass; edgetrain.models.decoders imports them all and is what callers use.

This module imports no model file, so that every architecture file can register here without a circle.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from edgetrain.registry import Registry


@dataclass(frozen=True)
class DecoderArchitecture:
    """One decoder architecture. `model_type` is config.json's model_type; `gguf_name` a GGUF file's
    general.architecture, where llama.cpp names it otherwise."""

    model_type: str
    config_class: type  # a LlamaConfig (sub)class: its defaults are the architecture's own features
    hf_class: str  # transformers' model class, written into a merged checkpoint's config.json
    # Config fields the architecture fixes whatever a file says (Qwen2 always has q/k/v biases).
    fixed: Mapping[str, Any] = field(default_factory=dict)
    # convert_hf_to_gguf reorders the rows of Q and K within each head (interleaved RoPE pairs): llama only.
    gguf_permutes_qk: bool = False
    gguf_name: str | None = None
    # What a checkpoint's norm weights lack of the factor they multiply by (Gemma's 1 + w); a GGUF has it.
    norm_offset: float = 0.0
    # llama.cpp block tensor names that mean another module here than for Llama (Gemma's sandwich norms).
    gguf_block_tensors: Mapping[str, str] = field(default_factory=dict)
    # GGUF metadata -> config fields of the architecture's own: gguf_fields(read, layers, hidden, heads, head_dim)
    # with read(key after "{arch}.", default).
    gguf_fields: Callable[..., dict[str, Any]] | None = None

    @property
    def gguf_architecture(self) -> str:
        return self.gguf_name or self.model_type

    def config(self, **values: Any) -> Any:
        """The architecture's config from the fields a file gave (a file cannot turn a fixed feature off)."""
        return self.config_class(**{**values, **self.fixed, "model_type": self.model_type})


DECODER_ARCHITECTURES: Registry[DecoderArchitecture] = Registry("decoder architecture")


def register_decoder(architecture: DecoderArchitecture) -> DecoderArchitecture:
    DECODER_ARCHITECTURES.add(architecture.model_type, architecture)
    return architecture
