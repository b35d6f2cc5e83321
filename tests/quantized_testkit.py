"""Helpers for tests of packed (quantised) models."""
from __future__ import annotations

import copy

import torch
from torch import nn

from edgetrain.models.quantized import QuantizedEmbedding, QuantizedLinear, TiedQuantizedHead


def dense_twin(model: nn.Module) -> nn.Module:
    """The same model with every packed matrix replaced by its dense module holding the dequantised weight
    (a tied quantised head tied to the dense embedding again)."""
    twin = copy.deepcopy(model)
    for module in list(twin.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, QuantizedLinear):
                dense = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                dense = dense.to(child.dtype)
                with torch.no_grad():
                    dense.weight.copy_(child.dequantize())
                    if child.bias is not None:
                        dense.bias.copy_(child.bias)
                dense.requires_grad_(False)
                setattr(module, name, dense)
            elif isinstance(child, QuantizedEmbedding):
                dense = nn.Embedding(child.num_embeddings, child.embedding_dim).to(child.dtype)
                with torch.no_grad():
                    dense.weight.copy_(child.dequantize())
                dense.requires_grad_(False)
                setattr(module, name, dense)
    if isinstance(twin.head.lm_head, TiedQuantizedHead):
        twin.head.lm_head = nn.Linear(twin.config.hidden_size, twin.config.vocab_size, bias=False)
        twin.head.lm_head.weight = twin.embed.embed_tokens.weight
    return twin
