"""LoRA adapters as llama.cpp reads them: a GGUF file of `general.type` "adapter", `adapter.type` "lora",
`adapter.lora.alpha`, and for every adapted base tensor `blk.N.attn_q.weight` the pair
`blk.N.attn_q.weight.lora_a` [rank, in] and `.lora_b` [out, rank] (torch order; GGUF lists the dimensions
the other way round). llama.cpp adds scale * B (A x) with scale = alpha / rank, as edgetrain does.

llama.cpp's model has the Q and K rows of llama checkpoints permuted within each head (interleaved RoPE
pairs, see edgetrain.models.gguf.loader), so an adapter on q or k must have its B rows permuted the same
way: B W-rows go with the base rows they add to. A is untouched. Qwen2 GGUFs are not permuted.

Writing needs the `gguf` package (pip install 'edgetrain[gguf]'); reading uses edgetrain's own GGUF
reader, which checks the file before trusting it.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import torch

from edgetrain.models.gguf.writing import finish_gguf
from edgetrain.models.decoders import architecture_of
from edgetrain.models.llama import LlamaConfig
from edgetrain.models.lora import LORA_TARGETS, AdapterError, LoraConfig
from edgetrain.utils.logs import get_logger

log = get_logger(__name__)

_EDGETRAIN_KEY = re.compile(r"^blocks\.(\d+)\.(.+)\.lora_([AB])$")
# ASCII digits without a leading zero (\d takes other scripts' digits, int() reads them, and "$" a trailing
# newline), at most 9: a name edgetrain cannot place is named, never mapped to another block.
_GGUF_KEY = re.compile(r"blk\.(0|[1-9][0-9]{0,8})\.([a-z_]+)\.weight\.lora_([ab])", re.ASCII)
GGUF_ADAPTER_TYPES = ("F32", "F16", "BF16", "Q8_0")  # what llama.cpp's convert_lora_to_gguf writes


def _gguf_modules() -> dict[str, str]:
    """edgetrain target -> llama.cpp's tensor name inside a block (q -> attn_q, down -> ffn_down)."""
    from edgetrain.models.gguf.loader import BLOCK_TENSORS

    by_path = {path: gguf for gguf, path in BLOCK_TENSORS.items()}
    return {target: by_path[path] for target, path in LORA_TARGETS.items()}


def _rope_heads(base: LlamaConfig, module: str) -> int | None:
    from edgetrain.models.gguf.loader import rope_heads

    return rope_heads(base, f"blk.0.{module}.weight")


def gguf_lora_name(name: str, base: LlamaConfig) -> tuple[str, int | None]:
    """edgetrain's adapter tensor name -> (llama.cpp's name, heads whose rows to permute or None)."""
    match = _EDGETRAIN_KEY.fullmatch(name)
    targets = {path: target for target, path in LORA_TARGETS.items()}
    if match is None or match.group(2) not in targets:
        raise AdapterError(f"{name!r} is not a decoder block's LoRA tensor")
    block, path, half = match.groups()
    module = _gguf_modules()[targets[path]]
    heads = _rope_heads(base, module) if half == "B" else None
    return f"blk.{block}.{module}.weight.lora_{half.lower()}", heads


def write_gguf_lora(config: LoraConfig, tensors: dict[str, torch.Tensor], path: str | Path,
                    base: LlamaConfig, base_model: str | None = None) -> Path:
    """Adapter `tensors` (edgetrain names) with `config` as a llama.cpp LoRA GGUF for a `base` decoder,
    written atomically, in float32 (exact)."""
    try:
        import gguf
    except ImportError as exc:
        raise AdapterError(f"writing a GGUF adapter needs the gguf package (pip install 'edgetrain[gguf]'): "
                           f"{exc}") from None
    from edgetrain.files.space import tensor_bytes
    from edgetrain.training.checkpoint import atomic_write_file

    arrays: dict[str, np.ndarray] = {}
    for name in sorted(tensors, key=_block_order):
        gguf_name, heads = gguf_lora_name(name, base)
        tensor = tensors[name].detach().to("cpu", torch.float32)
        if heads is not None:
            from edgetrain.models.gguf.loader import permute_rope_rows

            tensor = permute_rope_rows(tensor, heads)
        arrays[gguf_name] = np.ascontiguousarray(tensor.numpy())

    def fill(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), architecture_of(base).gguf_architecture)
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(config.alpha))
        writer.add_name("edgetrain LoRA adapter" + (f" for {base_model}" if base_model else ""))
        if base_model:
            writer.add_string("edgetrain.base_model", str(base_model))
        for gguf_name, array in arrays.items():
            writer.add_tensor(gguf_name, array)
        finish_gguf(writer)

    return atomic_write_file(path, fill, needed=tensor_bytes(arrays.values()))


def _block_order(name: str) -> tuple[int, str]:
    match = _EDGETRAIN_KEY.fullmatch(name)
    return (int(match.group(1)), name) if match else (-1, name)


def is_gguf_file(path: str | Path) -> bool:
    path = Path(path)
    if not path.is_file():
        return False
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == b"GGUF"
    except OSError:
        return False


def _metadata_text(metadata: dict, key: str) -> str | None:
    value = metadata.get(key)
    return value if isinstance(value, str) else None


def _alpha(metadata: dict, source: Path, rank: int) -> float:
    """adapter.lora.alpha; llama.cpp reads a missing or zero alpha as scale 1, which is alpha = rank."""
    alpha = metadata.get("adapter.lora.alpha", 0.0)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha < 0:
        raise AdapterError(f"{source}: adapter.lora.alpha = {alpha!r} is not a finite number >= 0")
    if alpha == 0:
        log.info("%s: no adapter.lora.alpha; llama.cpp then applies scale 1, read as alpha = rank = %d",
                 source, rank)
        return float(rank)
    return float(alpha)


def read_gguf_lora(path: str | Path, base: LlamaConfig) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """(config, tensors under edgetrain's names) of a llama.cpp LoRA GGUF for a `base` decoder. The file
    must be a LoRA adapter for the base's architecture, adapting whole modules of every block with one
    rank; anything else (norm or embedding adapters, layer subsets, mixed ranks) is refused by name."""
    from edgetrain.models.gguf.dequant import DEQUANTIZERS, dequantize
    from edgetrain.models.gguf.reader import GGUFError, read_gguf

    source = Path(path)
    try:
        gguf_file = read_gguf(source)
    except GGUFError as exc:
        raise AdapterError(str(exc)) from None
    metadata = gguf_file.metadata
    kind, adapter_type = _metadata_text(metadata, "general.type"), _metadata_text(metadata, "adapter.type")
    if kind != "adapter" or adapter_type != "lora":
        raise AdapterError(f"{source}: not a LoRA adapter GGUF (general.type {kind!r}, adapter.type "
                           f"{adapter_type!r}; expected 'adapter' and 'lora')")
    arch = _metadata_text(metadata, "general.architecture")
    if arch != architecture_of(base).gguf_architecture:
        raise AdapterError(f"{source}: the adapter is for a {arch!r} model, the base model is "
                           f"{architecture_of(base).gguf_architecture!r}")
    targets_by_module = {module: target for target, module in _gguf_modules().items()}
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for info in gguf_file.tensors.values():
        match = _GGUF_KEY.fullmatch(info.name)
        if match is None or match.group(2) not in targets_by_module:
            raise AdapterError(f"{source}: tensor {info.name!r} is not a LoRA weight edgetrain can apply "
                               f"(blk.N.<{'|'.join(targets_by_module)}>.weight.lora_a/lora_b)")
        if int(match.group(1)) >= base.num_hidden_layers:  # named here, before its pair is found wanting
            raise AdapterError(f"{source}: cannot place tensor {info.name!r}: block {match.group(1)}, and the base "
                               f"model has {base.num_hidden_layers} blocks")
        if info.ggml_type not in DEQUANTIZERS or info.type_name not in GGUF_ADAPTER_TYPES:
            raise AdapterError(f"{source}: tensor {info.name!r} is stored as {info.type_name}; adapters are "
                               f"read in {', '.join(GGUF_ADAPTER_TYPES)}")
        if len(info.shape) != 2:
            raise AdapterError(f"{source}: tensor {info.name!r} has shape {info.shape}, not a matrix")
        values = dequantize(gguf_file.tensor_bytes(info), info.ggml_type, info.shape)
        block, module, half = int(match.group(1)), match.group(2), match.group(3)
        pairs.setdefault((block, module), {})[half] = torch.from_numpy(np.array(values, dtype=np.float32))
    return _to_edgetrain(pairs, targets_by_module, metadata, source, base)


def _to_edgetrain(pairs: dict[tuple[int, str], dict[str, torch.Tensor]], targets_by_module: dict[str, str],
                  metadata: dict, source: Path, base: LlamaConfig) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    if not pairs:
        raise AdapterError(f"{source}: the adapter holds no LoRA tensors")
    modules = {module for _, module in pairs}
    blocks = range(base.num_hidden_layers)
    for (block, module), pair in sorted(pairs.items()):
        if set(pair) != {"a", "b"}:
            raise AdapterError(f"{source}: blk.{block}.{module}.weight has lora_{next(iter(pair))} without "
                               f"lora_{'b' if 'a' in pair else 'a'}")
    for module in sorted(modules):
        present = sorted(block for block, m in pairs if m == module)
        if present != list(blocks):
            raise AdapterError(f"{source}: {module} is adapted in blocks {present} but the base model has "
                               f"{base.num_hidden_layers}; edgetrain adapts every block")
    ranks = {tuple(pair["a"].shape)[0] for pair in pairs.values()}
    if len(ranks) != 1:
        raise AdapterError(f"{source}: the LoRA tensors have ranks {sorted(ranks)}; edgetrain's LoRA has one rank")
    rank = ranks.pop()
    order = list(LORA_TARGETS)
    targets = tuple(sorted((targets_by_module[m] for m in modules), key=order.index))
    config = LoraConfig(rank=rank, alpha=_alpha(metadata, source, rank), targets=targets)
    tensors: dict[str, torch.Tensor] = {}
    for (block, module), pair in pairs.items():
        path = LORA_TARGETS[targets_by_module[module]]
        lora_b = pair["b"]
        if lora_b.shape[1] != rank:  # B [out, rank]: a B stored untransposed would otherwise load wrongly
            raise AdapterError(f"{source}: blk.{block}.{module}.weight.lora_b has shape {tuple(lora_b.shape)}, "
                               f"expected [out, {rank}]")
        heads = _rope_heads(base, module)
        if heads is not None:
            from edgetrain.models.gguf.loader import unpermute_rope_rows

            if lora_b.shape[0] % (2 * heads):
                raise AdapterError(f"{source}: blk.{block}.{module}.weight.lora_b has {lora_b.shape[0]} rows, "
                                   f"which do not split into {heads} heads")
            lora_b = unpermute_rope_rows(lora_b, heads)
        tensors[f"blocks.{block}.{path}.lora_A"] = pair["a"]
        tensors[f"blocks.{block}.{path}.lora_B"] = lora_b.contiguous()
    return config, tensors

