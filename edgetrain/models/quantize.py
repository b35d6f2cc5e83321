"""Quantising a loaded decoder's frozen base (edgetrain.models.quantized): the block projections' nn.Linear
become QuantizedLinear (inside their LoRA wrappers when adapted), and with them the token embedding and
the LM head, a tied head reading the embedding's packed table."""
from __future__ import annotations

from torch import nn

from edgetrain.models.lora import LORA_TARGETS, LoRALinear
from edgetrain.models.quantized import GROUP_SIZE, PackedMatrix, QuantizedEmbedding, QuantizedLinear, TiedQuantizedHead
from edgetrain.registry import EdgetrainError

# Groups of 64 inputs where a matrix's width allows (MLX's and mlx-lm's default: half the scale-and-bias
# memory of 32 at 4 bits, 0.5625 bytes a weight against 0.625), else 32.
LOAD_GROUP_SIZE = 64


def group_size_for(columns: int, group_size: int | None = None) -> int:
    """The group size quantising a matrix of `columns` inputs: `group_size` when given, else
    LOAD_GROUP_SIZE where it divides the width, else GROUP_SIZE."""
    if group_size is not None:
        return group_size
    return LOAD_GROUP_SIZE if columns % LOAD_GROUP_SIZE == 0 else GROUP_SIZE


def quantize_linears(model: nn.Module, bits: int, group_size: int | None = None) -> int:
    """Replace the base nn.Linear of every block projection of a decoder (inside its LoRA wrapper, when
    adapted) by a QuantizedLinear of `bits` bits, in groups of `group_size` inputs (group_size_for by
    default); how many were replaced. Embedding, LM head and norms are left as they are (quantize_base
    takes the embedding and head too)."""
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
            setattr(owner, attribute, QuantizedLinear.from_dense(linear.weight, bits, linear.bias,
                                                                 group_size_for(linear.in_features, group_size)))
            replaced += 1
    return replaced


def quantize_embeddings(model: nn.Module, bits: int, group_size: int | None = None) -> int:
    """Replace a decoder's token embedding and LM head by packed ones of `bits` bits (a tied head by a
    TiedQuantizedHead over the packed embedding); how many matrices were packed (0, 1 or 2)."""
    embed, head = getattr(model, "embed", None), getattr(model, "head", None)
    table, lm_head = getattr(embed, "embed_tokens", None), getattr(head, "lm_head", None)
    if table is None or lm_head is None:
        raise EdgetrainError(f"quantize_embeddings: a {type(model).__name__} has no embed.embed_tokens and "
                             "head.lm_head")
    tied = type(lm_head) is nn.Linear and type(table) is nn.Embedding and lm_head.weight is table.weight
    packed = 0
    if type(table) is nn.Embedding:
        embed.embed_tokens = table = QuantizedEmbedding.from_dense(
            table.weight, bits, group_size_for(table.embedding_dim, group_size))
        packed += 1
    elif not isinstance(table, PackedMatrix):
        raise EdgetrainError(f"quantize_embeddings: embed.embed_tokens is a {type(table).__name__}")
    if tied:
        head.lm_head = TiedQuantizedHead(table)
    elif type(lm_head) is nn.Linear:
        head.lm_head = QuantizedLinear.from_dense(lm_head.weight, bits, lm_head.bias,
                                                 group_size_for(lm_head.in_features, group_size))
        packed += 1
    elif not isinstance(lm_head, (QuantizedLinear, TiedQuantizedHead)):
        raise EdgetrainError(f"quantize_embeddings: head.lm_head is a {type(lm_head).__name__}")
    return packed


def quantize_base(model: nn.Module, bits: int, group_size: int | None = None) -> int:
    """The whole frozen base in `bits` bits: block projections, token embedding and LM head (norms and
    projection biases stay in the model's dtype); how many matrices were packed."""
    return quantize_linears(model, bits, group_size) + quantize_embeddings(model, bits, group_size)
