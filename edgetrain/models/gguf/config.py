"""A GGUF file's metadata -> the config of its decoder architecture (edgetrain.models.decoders).

llama.cpp names hyper-parameters `{architecture}.{name}`; which of them a loader needs and their
defaults follow llama.cpp's own loader (head_count_kv defaults to head_count, freq_base to 10000).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from edgetrain.models.gguf.reader import GGUFError, GGUFFile, StringArray
from edgetrain.models.decoders import NOT_BUILT, gguf_architectures
from edgetrain.models.llama import ConfigError, LlamaConfig

# LlamaConfig field -> the GGUF key (after "{arch}.") it came from, to name the key in a config error.
_FIELD_KEYS = {"vocab_size": "vocab_size (rows of token_embd.weight)", "hidden_size": "embedding_length",
               "intermediate_size": "feed_forward_length", "num_hidden_layers": "block_count",
               "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv",
               "head_dim": "attention.key_length", "rms_norm_eps": "attention.layer_norm_rms_epsilon",
               "rope_theta": "rope.freq_base", "max_position_embeddings": "context_length"}


def _describe(value: Any) -> str:
    if isinstance(value, (list, np.ndarray)):
        return f"an array of {len(value)} values"
    return f"{type(value).__name__} {value!r}"


def metadata_int(gguf: GGUFFile, key: str, default: int | None = None) -> int:
    """An integer metadata value; a missing key without a default, or a value of another type, is an error."""
    if key not in gguf.metadata:
        if default is None:
            raise GGUFError(f"{gguf.path}: required metadata key {key!r} is missing")
        return default
    value = gguf.metadata[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise GGUFError(f"{gguf.path}: metadata {key!r} must be an integer, found {_describe(value)}")
    return value


def metadata_float(gguf: GGUFFile, key: str, default: float | None = None) -> float:
    if key not in gguf.metadata:
        if default is None:
            raise GGUFError(f"{gguf.path}: required metadata key {key!r} is missing")
        return default
    value = gguf.metadata[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GGUFError(f"{gguf.path}: metadata {key!r} must be a number, found {_describe(value)}")
    return float(value)


def metadata_str(gguf: GGUFFile, key: str, default: str | None = None) -> str:
    if key not in gguf.metadata:
        if default is None:
            raise GGUFError(f"{gguf.path}: required metadata key {key!r} is missing")
        return default
    value = gguf.metadata[key]
    if not isinstance(value, str):
        raise GGUFError(f"{gguf.path}: metadata {key!r} must be a string, found {_describe(value)}")
    return value


def architecture(gguf: GGUFFile) -> str:
    arch = metadata_str(gguf, "general.architecture")
    if arch not in gguf_architectures():
        why = f" ({NOT_BUILT[arch]})" if arch in NOT_BUILT and arch != "gemma3" else ""
        raise GGUFError(f"{gguf.path}: general.architecture {arch!r} is not supported{why}; edgetrain loads GGUF "
                        f"models of architecture {', '.join(sorted(gguf_architectures()))}")
    return arch


def _vocab_size(gguf: GGUFFile, arch: str) -> int:
    """The embedding's row count; the token list and `{arch}.vocab_size`, when present, must agree with it."""
    embedding = gguf.tensors.get("token_embd.weight")
    if embedding is None:
        raise GGUFError(f"{gguf.path}: no tensor 'token_embd.weight' (the token embedding)")
    if len(embedding.shape) != 2:
        raise GGUFError(f"{gguf.path}: tensor 'token_embd.weight' has shape {embedding.shape}; "
                        "a token embedding is 2-D")
    rows = embedding.shape[0]
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    if tokens is not None and not isinstance(tokens, (list, StringArray)):
        raise GGUFError(f"{gguf.path}: metadata 'tokenizer.ggml.tokens' must be an array of strings, "
                        f"found {_describe(tokens)}")
    if tokens is not None and len(tokens) != rows:
        raise GGUFError(f"{gguf.path}: tokenizer.ggml.tokens lists {len(tokens)} tokens but token_embd.weight "
                        f"has {rows} rows")
    declared = metadata_int(gguf, f"{arch}.vocab_size", rows)
    if declared != rows:
        raise GGUFError(f"{gguf.path}: metadata {arch}.vocab_size = {declared} but token_embd.weight has {rows} rows")
    return rows


def _linear_rope_scaling(gguf: GGUFFile, arch: str) -> dict[str, Any] | None:
    """`linear` RoPE scaling (Gemma 3 at 4B and up: positions divided by the factor); other types are refused
    (Llama 3's reaches a GGUF as rope_freqs.weight, read by _rope_scaling)."""
    scaling = metadata_str(gguf, f"{arch}.rope.scaling.type", "none")
    if scaling == "none":
        return None
    if scaling != "linear":
        raise GGUFError(f"{gguf.path}: metadata {arch}.rope.scaling.type = {scaling!r}: only linear RoPE scaling "
                        "is supported from GGUF metadata")
    factor = metadata_float(gguf, f"{arch}.rope.scaling.factor")
    return None if factor == 1.0 else {"rope_type": "linear", "factor": factor}


def _refuse_unsupported_features(gguf: GGUFFile, arch: str) -> None:
    if metadata_int(gguf, f"{arch}.expert_count", 0):
        raise GGUFError(f"{gguf.path}: metadata {arch}.expert_count > 0: mixture-of-experts models are not supported")


# Tensors that describe the model rather than hold its weights: read here, never planned as parameters.
CONFIG_TENSORS = ("rope_freqs.weight",)


def _rope_scaling(gguf: GGUFFile, theta: float, head_dim: int) -> dict[str, Any] | None:
    """Llama 3.x's RoPE scaling from its `rope_freqs.weight` (edgetrain.models.gguf.rope_freqs), or None."""
    from edgetrain.models.gguf.dequant import dequantize
    from edgetrain.models.gguf.rope_freqs import llama3_scaling_from_factors

    info = gguf.tensors.get("rope_freqs.weight")
    if info is None:
        return None
    if info.type_name not in ("F32", "F16"):
        raise GGUFError(f"{gguf.path}: tensor 'rope_freqs.weight' is stored as {info.type_name}; llama.cpp writes "
                        "RoPE frequency factors as F32")
    factors = dequantize(gguf.tensor_bytes(info), info.ggml_type, info.shape)
    try:
        return llama3_scaling_from_factors(factors, theta, head_dim)
    except ValueError as exc:
        raise GGUFError(f"{gguf.path}: tensor 'rope_freqs.weight' {exc}") from None


def config_from_metadata(gguf: GGUFFile) -> LlamaConfig:
    arch = architecture(gguf)
    decoder = gguf_architectures()[arch]
    _refuse_unsupported_features(gguf, arch)
    hidden = metadata_int(gguf, f"{arch}.embedding_length")
    heads = metadata_int(gguf, f"{arch}.attention.head_count")
    if heads <= 0:
        raise GGUFError(f"{gguf.path}: metadata {arch}.attention.head_count = {heads} must be positive")
    key_length = f"{arch}.attention.key_length"
    if key_length in gguf.metadata:
        head_dim = metadata_int(gguf, key_length)
        value_length = metadata_int(gguf, f"{arch}.attention.value_length", head_dim)
        if value_length != head_dim:
            raise GGUFError(f"{gguf.path}: metadata {arch}.attention.value_length {value_length} differs from "
                            f"key_length {head_dim}; the decoder needs them equal")
    elif hidden % heads:
        raise GGUFError(f"{gguf.path}: metadata {arch}.embedding_length {hidden} is not a multiple of "
                        f"{arch}.attention.head_count {heads}")
    else:
        head_dim = hidden // heads
    rope_dims = metadata_int(gguf, f"{arch}.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise GGUFError(f"{gguf.path}: metadata {arch}.rope.dimension_count {rope_dims} differs from the head "
                        f"size {head_dim}; partial rotary embeddings are not supported")
    theta = metadata_float(gguf, f"{arch}.rope.freq_base", 10000.0)
    rope_scaling = _rope_scaling(gguf, theta, head_dim) or _linear_rope_scaling(gguf, arch)
    layers = metadata_int(gguf, f"{arch}.block_count")
    own: dict[str, Any] = {}
    if decoder.gguf_fields is not None:
        own = decoder.gguf_fields(lambda key, default: gguf.metadata.get(f"{arch}.{key}", default), layers, hidden,
                                  heads, head_dim)
    try:
        return decoder.config(
            vocab_size=_vocab_size(gguf, arch),
            hidden_size=hidden,
            intermediate_size=metadata_int(gguf, f"{arch}.feed_forward_length"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=metadata_int(gguf, f"{arch}.attention.head_count_kv", heads),
            head_dim=head_dim,
            rms_norm_eps=metadata_float(gguf, f"{arch}.attention.layer_norm_rms_epsilon"),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings="output.weight" not in gguf.tensors,
            max_position_embeddings=metadata_int(gguf, f"{arch}.context_length"),
            **own,
        )
    except ConfigError as exc:
        field = str(exc).split("'")[1] if str(exc).count("'") >= 2 else ""
        key = f" (metadata {arch}.{_FIELD_KEYS[field]})" if field in _FIELD_KEYS else ""
        raise GGUFError(f"{gguf.path}: the metadata does not describe a working model: {exc}{key}") from None
