"""What a "nothing is lost" check compares for adapters: the model's whole state, which parameters train,
and how many LoRA layers it has (a failed load must not leave adapters it added)."""
from __future__ import annotations

from typing import Any

import torch

from edgetrain.models.lora import lora_layers


def snapshot(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, bool], int]:
    return ({name: p.detach().clone() for name, p in model.state_dict().items()},
            {name: p.requires_grad for name, p in model.named_parameters()}, len(lora_layers(model)))


def unchanged(model: torch.nn.Module, taken: Any) -> bool:
    state, flags, adapters = taken
    now = model.state_dict()
    return (set(now) == set(state) and all(torch.equal(now[k], v) for k, v in state.items())
            and {n: p.requires_grad for n, p in model.named_parameters()} == flags
            and len(lora_layers(model)) == adapters)
