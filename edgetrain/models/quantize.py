"""Quantising a loaded decoder's frozen base: every block projection's nn.Linear becomes a QuantizedLinear
(edgetrain.models.quantized), inside its LoRA wrapper when the model is adapted."""
from __future__ import annotations

from torch import nn

from edgetrain.models.lora import LORA_TARGETS, LoRALinear
from edgetrain.models.quantized import GROUP_SIZE, QuantizedLinear
from edgetrain.registry import EdgetrainError


def quantize_linears(model: nn.Module, bits: int, group_size: int = GROUP_SIZE) -> int:
    """Replace the base nn.Linear of every block projection of a decoder (inside its LoRA wrapper, when
    adapted) by a QuantizedLinear of `bits` bits; how many were replaced. Embedding, LM head and norms
    stay dense: the head is tied to the embedding in small models, and MeSP's chunked loss slices its rows."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise EdgetrainError(f"quantize_linears: a {type(model).__name__} has no decoder blocks")
    replaced = 0
    for block in blocks:
        for path in LORA_TARGETS.values():
            parent_path, _, name = path.rpartition(".")
            parent = block.get_submodule(parent_path)
            module = getattr(parent, name)
            owner, attribute = (module, "base") if isinstance(module, LoRALinear) else (parent, name)
            linear = getattr(owner, attribute)
            if isinstance(linear, QuantizedLinear):
                continue
            if type(linear) is not nn.Linear:
                raise EdgetrainError(f"quantize_linears: {path} is a {type(linear).__name__}, not an nn.Linear")
            setattr(owner, attribute, QuantizedLinear.from_dense(linear.weight, bits, linear.bias, group_size))
            replaced += 1
    return replaced
