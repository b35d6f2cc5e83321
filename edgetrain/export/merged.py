"""A decoder with its LoRA adapter merged into the base weights (W + alpha/rank * B A), written as a
Hugging Face checkpoint directory (config.json, model.safetensors, the tokenizer) or, for a model loaded
from a GGUF file, as a GGUF file in F32 or F16 with the base file's metadata and tokenizer, which
llama.cpp loads as any other model. Re-quantising (Q4/Q8) is not done: quantise the merged F16 file with
llama.cpp's llama-quantize if a smaller file is needed.

The model is not changed: the merged weights are computed beside it, in float64, and rounded once to the
output dtype.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from edgetrain.files.space import tensor_bytes
from edgetrain.models.gguf.writing import finish_gguf
from edgetrain.models.decoders import architecture_names, architecture_of
from edgetrain.models.hf_checkpoint import norm_offset
from edgetrain.models.llama import LlamaConfig
from edgetrain.registry import EdgetrainError
from edgetrain.utils.logs import get_logger

log = get_logger(__name__)

GGUF_DTYPES = {"f32": np.float32, "f16": np.float16}
# Files of a Hugging Face checkpoint that describe its tokenizer, copied as they are when the model's
# tokenizer came from such a directory.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class MergeError(EdgetrainError, ValueError):
    """A merged export that cannot be written as asked (no decoder, no GGUF base, a base that differs)."""


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under its plain (adapter-free) parameter names, every LoRA update added to its
    base weight; tied weights appear once, under the embedding's name."""
    from edgetrain.models.lora import lora_layers

    layers = lora_layers(model)
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        owner, _, leaf = name.rpartition(".")
        if leaf in ("lora_A", "lora_B"):
            continue
        layer_name = owner.removesuffix(".base")
        if owner.endswith(".base") and layer_name in layers:
            name = f"{layer_name}.{leaf}"
            if leaf == "weight":
                layer = layers[layer_name]
                delta = (layer.lora_B.detach().double() @ layer.lora_A.detach().double()) * layer.scale
                tensor = (tensor.double() + delta).to(tensor.dtype) if not layer.merged else tensor
        merged[name] = tensor.detach()
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        merged.pop("head.lm_head.weight", None)
    return merged


def _require_decoder(model: nn.Module) -> LlamaConfig:
    config = getattr(model, "config", None)
    if not isinstance(config, LlamaConfig) or config.model_type not in architecture_names():
        raise MergeError(f"merging needs a decoder ({', '.join(architecture_names())}); got {type(model).__name__}")
    from edgetrain.models.quantized import PackedMatrix, TiedQuantizedHead

    packed = [name for name, module in model.named_modules() if isinstance(module, (PackedMatrix, TiedQuantizedHead))]
    if packed:
        raise MergeError(f"the model's base is held packed ({packed[0]}, {len(packed)} matrices): merged weights are "
                         "dense, so load the base with LoadOptions(dequantize=True) (what `edgetrain export --merge` "
                         "does) and merge into that")
    return config


def hf_config_dict(config: LlamaConfig, dtype: torch.dtype, tokenizer: Any = None) -> dict[str, Any]:
    """config.json of a Hugging Face checkpoint for `config` (read back by transformers and edgetrain)."""
    from dataclasses import asdict

    raw = {key: value for key, value in asdict(config).items() if value is not None}
    raw["architectures"] = [architecture_of(config).hf_class]
    raw["torch_dtype"] = str(dtype).removeprefix("torch.")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            raw[name] = int(value)
    return raw


def _write_tokenizer(tokenizer: Any, directory: Path) -> None:
    """The model's tokenizer beside the weights: the files it was read from, or (a GGUF's vocabulary)
    tokenizer.json written from it with a tokenizer_config.json naming its special tokens and chat template."""
    source = getattr(tokenizer, "path", None)
    if source is not None and Path(source).name == "tokenizer.json" and Path(source).is_file():
        for name in _TOKENIZER_FILES:
            if (Path(source).parent / name).is_file():
                shutil.copyfile(Path(source).parent / name, directory / name)
        return
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        log.info("the model has no tokenizer of its own (byte tokens); the checkpoint is written without one")
        return
    backend.save(str(directory / "tokenizer.json"))
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for name in ("bos", "eos", "unk", "pad"):
        token_id = getattr(tokenizer, f"{name}_token_id", None)
        if token_id is not None:
            config[f"{name}_token"] = backend.id_to_token(int(token_id))
    if getattr(tokenizer, "chat_template", None):
        config["chat_template"] = tokenizer.chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def save_merged_hf(model: nn.Module, directory: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write `model` with its adapter merged as a Hugging Face checkpoint directory (atomically): what
    transformers' from_pretrained and edgetrain.load_model read. `dtype` defaults to the model's."""
    from safetensors.torch import save_file

    from edgetrain.models.llama import edgetrain_key_to_hf
    from edgetrain.training.checkpoint import atomic_write_directory

    config = _require_decoder(model)
    state = merged_state_dict(model)
    dtype = dtype or next(iter(state.values())).dtype
    offset = norm_offset(config)  # Gemma's checkpoints hold w of its 1 + w norms
    tensors = {edgetrain_key_to_hf(name): (tensor.float() - offset if offset and name.endswith("norm.weight")
                                           else tensor).to("cpu", dtype).contiguous() for name, tensor in state.items()}
    tokenizer = getattr(model, "tokenizer", None)

    def fill(staging: Path) -> None:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(hf_config_dict(config, dtype, tokenizer), indent=2))
        _write_tokenizer(tokenizer, staging)

    return atomic_write_directory(directory, fill, needed=tensor_bytes(tensors.values()))


def save_merged_gguf(model: nn.Module, base_gguf: str | Path, path: str | Path, dtype: str = "f16") -> Path:
    """Write `model` (loaded from `base_gguf`) with its adapter merged as a GGUF file for llama.cpp,
    atomically: the base file's metadata (architecture, hyper-parameters, tokenizer, chat template) and
    tensor order, 2-D weights in `dtype` ("f32" or "f16"), norms in F32 as llama.cpp expects. Needs the
    `gguf` package (pip install 'edgetrain[gguf]')."""
    try:
        import gguf
    except ImportError as exc:
        raise MergeError(f"writing a GGUF file needs the gguf package (pip install 'edgetrain[gguf]'): {exc}") from None
    from edgetrain.models.gguf.config import config_from_metadata
    from edgetrain.models.gguf.config import CONFIG_TENSORS
    from edgetrain.models.gguf.loader import gguf_name_to_edgetrain, permute_rope_rows, read_values, rope_heads
    from edgetrain.models.gguf.reader import read_gguf
    from edgetrain.training.checkpoint import atomic_write_file

    if dtype not in GGUF_DTYPES:
        raise MergeError(f"merged GGUF dtype {dtype!r}; supported: {', '.join(GGUF_DTYPES)} "
                         "(quantise the result with llama.cpp's llama-quantize)")
    config = _require_decoder(model)
    base = read_gguf(base_gguf)
    if config_from_metadata(base) != config:
        raise MergeError(f"{base_gguf}: the model was not loaded from this GGUF (its hyper-parameters differ)")
    state = merged_state_dict(model)
    arrays: list[tuple[str, np.ndarray]] = []
    for info in base.tensors.values():
        if info.name in CONFIG_TENSORS:  # Llama 3's RoPE factors: the base's, as they are (F32)
            arrays.append((info.name, np.ascontiguousarray(read_values(base, info))))
            continue
        name = gguf_name_to_edgetrain(info.name, config)
        tensor = state[name].detach().to("cpu", torch.float64)
        heads = rope_heads(config, info.name)
        if heads is not None:
            tensor = permute_rope_rows(tensor, heads)
        # llama.cpp keeps norms (1-D) in F32 whatever the file type
        out_dtype = np.float32 if tensor.dim() == 1 else GGUF_DTYPES[dtype]
        arrays.append((info.name, np.ascontiguousarray(tensor.numpy().astype(out_dtype))))
    reader = gguf.GGUFReader(str(base_gguf))
    file_type = gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16

    def fill(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), architecture_of(config).gguf_architecture)
        for field in reader.fields.values():
            if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type",
                                                                 "general.alignment"):
                continue
            value_type = gguf.GGUFValueType(field.types[0])
            sub_type = gguf.GGUFValueType(field.types[-1]) if value_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
        writer.add_file_type(int(file_type))
        for name, array in arrays:
            writer.add_tensor(name, array)
        finish_gguf(writer)

    return atomic_write_file(path, fill, needed=tensor_bytes(array for _, array in arrays))
