"""Model registries: named presets (random init) and checkpoint architectures (by config.json model_type).

Every model edgetrain trains exposes the same *block view*, the only structure the methods rely on:
  model.embed  -- the stem (token embedding, conv stem, input projection ...)
  model.blocks -- an nn.ModuleList; each block maps one hidden state to the next, block(h) -> h
  model.head   -- maps the last hidden state to the output (logits)
  model.task   -- "lm" (next-token prediction over [B, T, vocab]) or "classify" ([B, classes])
and model(x) == model.head(blocks[-1](...blocks[0](model.embed(x)))).
"""
from __future__ import annotations

from typing import Any, Callable

from torch import nn

from edgetrain.registry import Registry

# name -> zero-argument builder returning a freshly initialised model
MODEL_PRESETS: Registry[Callable[[], nn.Module]] = Registry("model preset")

# config.json model_type -> builder taking the parsed config dict, returning a model with random weights
ARCHITECTURES: Registry[Callable[[dict[str, Any]], nn.Module]] = Registry("architecture")


def run_blocks(model: nn.Module, x: Any) -> Any:
    """The plain full forward through the block view (what every method must agree with)."""
    h = model.embed(x)
    for block in model.blocks:
        h = block(h)
    return model.head(h)
