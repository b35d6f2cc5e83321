"""Committed modules stay in eval() for the rest of a staged schedule, without replacing any method.

A committed segment's BatchNorm statistics must never move again, yet `model.train()` (Learner.evaluate
calls it) puts every submodule back in training mode. The stage adapters' container, `StageAdapters`, is
attached to the model as `model.stage_adapters` after the model's own modules, so `model.train()` reaches
it last (nn.Module.train visits children in registration order); its own `train`, a method of its class,
then puts the pinned modules back in eval(). Which modules are pinned is kept in a registry of weak
references, so `is_pinned` can be asked of any module and a deleted model leaves nothing behind.
"""
from __future__ import annotations

import weakref
from typing import Iterable

from torch import nn

_PINNED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def pin_eval(module: nn.Module) -> None:
    """Put `module` and its submodules in eval() and mark them pinned: the StageAdapters of the model
    they belong to puts them back in eval() after every later `model.train()`."""
    for sub in module.modules():
        _PINNED.add(sub)
    nn.Module.train(module, False)


def unpin_eval(module: nn.Module) -> None:
    for sub in module.modules():
        _PINNED.discard(sub)


def is_pinned(module: nn.Module) -> bool:
    return module in _PINNED


class StageAdapters(nn.ModuleDict):
    """The adapters (or auxiliary classifiers) of a staged schedule, keyed by stage index, and the keeper
    of the committed modules' eval() mode; see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.pinned: list[nn.Module] = []  # a plain list: the committed modules are the model's, not ours

    def pin(self, modules: Iterable[nn.Module]) -> None:
        """Pin exactly `modules` (and their submodules); whatever was pinned before is released."""
        self.release()
        self.pinned = list(modules)
        for module in self.pinned:
            pin_eval(module)

    def release(self) -> None:
        for module in self.pinned:
            unpin_eval(module)
        self.pinned = []

    def keep_pinned_in_eval(self) -> None:
        for module in self.pinned:
            nn.Module.train(module, False)

    def train(self, mode: bool = True) -> "StageAdapters":
        super().train(mode)
        self.keep_pinned_in_eval()
        return self
