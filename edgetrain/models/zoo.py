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


def example_input(model: nn.Module, batch_size: int, seq_len: int, generator: Any = None) -> Any:
    """A random input of the shape `model` takes: token ids [B, T] for models with a vocabulary,
    images/features [B, *shape] otherwise (the shape read off the model's config)."""
    import torch

    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"{type(model).__name__} has no config to read its input shape from")
    if hasattr(config, "vocab_size"):
        return torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=generator)
    if hasattr(config, "input_shape"):
        shape = tuple(config.input_shape)
    elif hasattr(config, "image_size"):
        shape = (config.in_channels, config.image_size, config.image_size)
    elif getattr(config, "stem", None) == "cifar" or getattr(config, "stem_stride", 2) == 1:
        shape = (config.in_channels, 32, 32)
    else:  # ImageNet-stem ResNets and MobileNets
        shape = (config.in_channels, 224, 224)
    return torch.rand((batch_size, *shape), generator=generator)
