"""GGUF file -> LlamaModel with dequantised weights in the requested dtype.

Tensor names are llama.cpp's (`blk.3.attn_q.weight`); they map one to one onto the Hugging Face layout
the decoder uses. For the llama architecture llama.cpp's converter reorders the rows of Q and K within
each head (interleaved RoPE pairs instead of rotate-half halves); that is undone here, so a GGUF model
equals the Hugging Face checkpoint it was converted from.

The MLX loader (edgetrain.backends.mlx.gguf) plans, reads, reorders and attaches the tokenizer with the
public functions here; only what a tensor becomes differs there.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgetrain.models.gguf.config import CONFIG_TENSORS, config_from_metadata, metadata_str
from edgetrain.models.gguf.dequant import DEQUANTIZERS, SUPPORTED_TYPE_NAMES, dequantize
from edgetrain.models.gguf.reader import GGUFError, GGUFFile, TensorInfo, read_gguf
from edgetrain.models.gguf.tokenizer import SUPPORTED_TOKENIZER_MODELS, GGUFTokenizer, gguf_tokenizer
from edgetrain.models.decoders import architecture_of
from edgetrain.models.hf_checkpoint import load_weights
from edgetrain.models.llama import LlamaConfig, LlamaModel
from edgetrain.utils.logs import get_logger
from edgetrain.models.meta_build import meta_without_init

log = get_logger(__name__)
# Float types: read as they are, never "dequantised" (widened to the requested dtype at most).
DENSE_TYPES = frozenset({"F32", "F16", "BF16", "F64"})

_GLOBAL_TENSORS = {"token_embd.weight": "embed.embed_tokens.weight", "output_norm.weight": "head.norm.weight",
                   "output.weight": "head.lm_head.weight"}
BLOCK_TENSORS = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                  "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                  "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                  "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                  "ffn_down": "mlp.down_proj"}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")


def block_tensors(config: LlamaConfig | None = None) -> dict[str, str]:
    """llama.cpp's block tensor names -> the block's module paths, for the config's architecture."""
    return {**BLOCK_TENSORS, **(architecture_of(config).gguf_block_tensors if config is not None else {})}


def gguf_name_to_edgetrain(name: str, config: LlamaConfig | None = None) -> str | None:
    """The decoder parameter a llama.cpp tensor name stands for (in the config's architecture); None if it
    names none."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    match = _BLOCK_NAME.fullmatch(name)
    modules = block_tensors(config)
    if match and match.group(2) in modules:
        return f"blocks.{int(match.group(1))}.{modules[match.group(2)]}.{match.group(3)}"
    return None


def unpermute_rope_rows(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's `permute` of a llama Q or K weight (or bias): within each head it
    moved row pairs (i, i + half) next to each other; this puts the two halves back."""
    rows = tensor.shape[0]
    rest = tensor.shape[1:]
    return tensor.reshape(heads, rows // heads // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def permute_rope_rows(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """What convert_hf_to_gguf does to a llama Q or K weight (the inverse of unpermute_rope_rows): within
    each head, rows i and i + half become neighbours (interleaved RoPE pairs)."""
    rows = tensor.shape[0]
    rest = tensor.shape[1:]
    return tensor.reshape(heads, 2, rows // heads // 2, *rest).transpose(1, 2).reshape(rows, *rest)


def rope_heads(config: LlamaConfig, gguf_name: str) -> int | None:
    """Heads whose rows to unpermute for this tensor, or None: only llama's Q and K are permuted."""
    if not architecture_of(config).gguf_permutes_qk:
        return None
    if ".attn_q." in gguf_name:
        return config.num_attention_heads
    if ".attn_k." in gguf_name:
        return config.num_key_value_heads
    return None


def rope_row_order(config: LlamaConfig, gguf_name: str, rows: int) -> np.ndarray | None:
    """The row order that undoes the converter's Q/K permutation (`values[order]`), or None when the tensor
    is not permuted. An index array, so that a loader can reorder rows it does not hold as floats (MLX's
    packed 4-bit rows with their scales); it is unpermute_rope_rows applied to the row numbers."""
    heads = rope_heads(config, gguf_name)
    if heads is None:
        return None
    return unpermute_rope_rows(torch.arange(rows), heads).numpy()


def plan_tensors(gguf: GGUFFile, config: LlamaConfig,
                 expected: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[str, TensorInfo]]:
    """GGUF name -> (parameter name, tensor info), every name, shape and type checked before any data is read.

    `expected` is the decoder's parameter names and shapes (a tied LM head may be among them or not);
    every framework's loader plans through here, so all refuse the same files with the same words."""
    tied = {"head.lm_head.weight"} if config.tie_word_embeddings else set()
    plan: dict[str, tuple[str, TensorInfo]] = {}
    for info in gguf.tensors.values():
        if info.name in CONFIG_TENSORS:  # read into the config (config_from_metadata)
            continue
        target = gguf_name_to_edgetrain(info.name, config)
        if target is None or target not in expected:
            raise GGUFError(f"{gguf.path}: tensor {info.name!r} does not belong to a "
                            f"{config.num_hidden_layers}-layer {config.model_type} decoder")
        want = tuple(expected[target])
        if info.shape != want:
            raise GGUFError(f"{gguf.path}: tensor {info.name!r} has shape {info.shape}, the model described "
                            f"by the metadata expects {want}")
        if info.ggml_type not in DEQUANTIZERS:
            raise GGUFError(f"{gguf.path}: tensor {info.name!r} is stored as {info.type_name}, which edgetrain "
                            f"cannot dequantise yet; supported: {', '.join(SUPPORTED_TYPE_NAMES)}")
        plan[info.name] = (target, info)
    loaded = {target for target, _ in plan.values()}
    missing = [name for name in expected if name not in loaded and name not in tied]
    if missing:
        raise GGUFError(f"{gguf.path}: missing tensor(s) for {', '.join(missing[:5])}"
                        + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    return plan


def read_values(gguf: GGUFFile, info: TensorInfo) -> np.ndarray:
    """One tensor's values as a float32 numpy array (in the GGUF layout: llama Q/K rows still permuted)."""
    values = dequantize(gguf.tensor_bytes(info), info.ggml_type, info.shape)
    gguf.release(info)  # the values are a copy: the file's pages need not stay resident
    if not np.isfinite(values).all():
        raise GGUFError(f"{gguf.path}: tensor {info.name!r} holds NaN or infinite values")
    return values


def read_tensor(gguf: GGUFFile, info: TensorInfo) -> torch.Tensor:
    """One tensor's values as float32 (in the GGUF layout: llama Q/K rows still permuted)."""
    return torch.from_numpy(read_values(gguf, info))


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu", quantized: bool = False) -> LlamaModel:
    """A llama / qwen2 decoder from a GGUF file, weights dequantised to `dtype` on `device`. The file's
    byte-level BPE vocabulary, when it has one, becomes `model.tokenizer` (read with model_tokenizer).

    `quantized=True` keeps every matrix stored in a ggml block format packed (edgetrain.models.quantized:
    the file's integers and scales, not requantised): block projections as QuantizedLinear, the token
    embedding as QuantizedEmbedding and the LM head as a QuantizedLinear, or, tied, a TiedQuantizedHead
    over the embedding. Norms and matrices stored in other types are dense."""
    gguf = read_gguf(path)
    config = config_from_metadata(gguf)
    tokenizer = take_gguf_tokenizer(gguf)
    with meta_without_init():  # no random init: every weight is assigned from the file
        model = LlamaModel(config)
    tensors: dict[str, torch.Tensor] = {}
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict(keep_vars=True).items()}
    packed_embedding = False
    dequantised: list[str] = []
    for gguf_name, (target, info) in plan_tensors(gguf, config, expected).items():
        if quantized and _install_packed(model, gguf, info, target, config, gguf_name, dtype, tensors):
            packed_embedding |= target == _EMBEDDING
            continue
        if quantized and info.type_name not in DENSE_TYPES:
            dequantised.append(f"{gguf_name} ({info.type_name})")
        tensor = read_tensor(gguf, info)
        heads = rope_heads(config, gguf_name)
        if heads is not None:
            tensor = unpermute_rope_rows(tensor, heads)
        tensors[target] = tensor.to(dtype)
    if packed_embedding and config.tie_word_embeddings:
        from edgetrain.models.quantized import TiedQuantizedHead
        # It reads the embedding module's table, whatever tensors loading assigns to it.
        model.head.lm_head = TiedQuantizedHead(model.embed.embed_tokens)
    if dequantised:
        # One line per load: the memory figures of a "packed" model hold these densely.
        log.info("%s: %d tensor(s) that edgetrain keeps packed only as block projections, the embedding or the "
                 "LM head were dequantised to %s: %s", gguf.path, len(dequantised), str(dtype).removeprefix("torch."),
                 ", ".join(dequantised[:8]) + (", ..." if len(dequantised) > 8 else ""))
    packed_tensors = [name for name in tensors if name.endswith((".scales", ".biases", ".codebook"))]
    load_weights(model, tensors, str(gguf.path), dtype, as_stored=packed_tensors)
    _realise_dtype_markers(model, dtype)
    attach_gguf_tokenizer(model, tokenizer)
    return model.to(device)


def load_packed_gguf(path: str | Path, dtype: str | torch.dtype = torch.float32,
                     device: torch.device | str = "cpu") -> LlamaModel:
    """load_gguf(..., quantized=True): matrices stored in ggml block formats kept packed (the default of
    edgetrain.load_model for a GGUF)."""
    from edgetrain.models import parse_dtype

    return load_gguf(path, dtype=parse_dtype(dtype), device=device, quantized=True)


_PROJECTION = re.compile(r"(blocks\.\d+\.(?:self_attn|mlp)\.[a-z_]+_proj)\.weight")
_EMBEDDING, _HEAD = "embed.embed_tokens.weight", "head.lm_head.weight"


def _install_packed(model: LlamaModel, gguf: GGUFFile, info: TensorInfo, target: str, config: LlamaConfig,
                    gguf_name: str, dtype: torch.dtype, tensors: dict[str, torch.Tensor]) -> bool:
    """Put a packed shell (meta device) where a packable matrix is -- a block projection, the token
    embedding or an untied LM head -- and its packed tensors into `tensors` for load_weights; False when
    the tensor is not one (it is read dense)."""
    from edgetrain.models.gguf.blocks import BLOCK_FORMATS
    from edgetrain.models.gguf.packed_rows import split_rows
    from edgetrain.models.quantized import QuantizedEmbedding, QuantizedLinear

    match = _PROJECTION.fullmatch(target)
    if (match is None and target not in (_EMBEDDING, _HEAD)) or info.ggml_type not in BLOCK_FORMATS:
        return False
    packed = split_rows(gguf.tensor_bytes(info), info.ggml_type, info.shape)
    gguf.release(info)  # repacked into new arrays: the file's pages need not stay resident
    if not packed.all_finite():
        raise GGUFError(f"{gguf.path}: tensor {info.name!r} holds NaN or infinite values")
    order = rope_row_order(config, gguf_name, info.shape[0])
    if order is not None:
        packed = packed.rows(order)
    module_path = target.rpartition(".")[0]
    parent_path, _, attribute = module_path.rpartition(".")
    parent = model.get_submodule(parent_path)
    dense = getattr(parent, attribute)
    compute = dtype if dtype.is_floating_point else torch.float32
    if target == _EMBEDDING:
        layer = QuantizedEmbedding.from_rows(packed, dtype=compute)
        with meta_without_init():
            shell = QuantizedEmbedding(layer.num_embeddings, layer.embedding_dim, layer.bits, layer.group_size,
                                       dtype=compute, storage_dtype=layer.scales.dtype, layout=layer.layout)
    else:
        layer = QuantizedLinear.from_rows(packed, dtype=compute)
        with meta_without_init():
            shell = QuantizedLinear(layer.in_features, layer.out_features, layer.bits, layer.group_size,
                                    bias=dense.bias is not None, dtype=compute, storage_dtype=layer.scales.dtype,
                                    layout=layer.layout)
    setattr(parent, attribute, shell)
    for name, tensor in layer.named_buffers(recurse=False):
        if name not in ("_dtype_marker", "bias"):  # a layout without biases or steps has none (PackedMatrix)
            tensors[f"{module_path}.{name}"] = tensor
    return True


def _realise_dtype_markers(model: Any, dtype: torch.dtype) -> None:
    """Packed shells were built on the meta device; their (empty) dtype markers are not loaded tensors."""
    from edgetrain.models.quantized import PackedMatrix

    compute = dtype if dtype.is_floating_point else torch.float32
    for module in model.modules():
        if isinstance(module, PackedMatrix) and module._dtype_marker.is_meta:
            module._dtype_marker = torch.empty(0, dtype=compute)


# The metadata arrays that hold the vocabulary: tens of thousands of strings each.
VOCABULARY_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")


def take_gguf_tokenizer(gguf: GGUFFile) -> GGUFTokenizer | None:
    """The file's own vocabulary as a tokenizer; None when it has none, or one that cannot be built yet
    (SentencePiece, said in a warning); a damaged one is an error, as a damaged tokenizer.json is.

    The vocabulary arrays then leave `gguf.metadata` (read the config first). A loader calls this before it
    reads any tensor: a damaged vocabulary is refused before the weights are read, and the arrays (3 MiB
    for SmolLM2's 49k tokens and merges) are gone before the weights arrive."""
    tokenizer = None
    if "tokenizer.ggml.model" in gguf.metadata:
        kind = metadata_str(gguf, "tokenizer.ggml.model")
        if kind in SUPPORTED_TOKENIZER_MODELS:
            tokenizer = gguf_tokenizer(gguf)
        else:
            log.warning("%s: tokenizer.ggml.model %r is not supported yet; the model is loaded without a "
                        "tokenizer (training text would be byte ids)", gguf.path, kind)
    for key in VOCABULARY_KEYS:
        gguf.metadata.pop(key, None)
    return tokenizer


def attach_gguf_tokenizer(model: Any, tokenizer: GGUFTokenizer | None) -> None:
    """take_gguf_tokenizer's tokenizer becomes `model.tokenizer`, as a checkpoint's tokenizer.json does."""
    from edgetrain.data.tokenizer import attach_tokenizer

    if tokenizer is not None:
        attach_tokenizer(model, tokenizer, model.config.vocab_size)
