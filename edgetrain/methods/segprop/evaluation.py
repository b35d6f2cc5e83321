"""Evaluating a stage's training path (adapter or auxiliary classifier included): the paper's
"Test (aux)". Runs every module in eval() and puts each module's own mode back afterwards, so the
committed modules' pins and the active modules' training mode are untouched."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from edgetrain.methods.segprop.plan import Stage
from edgetrain.methods.segprop.stage_parts import StageParts


@contextmanager
def all_in_eval(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Every submodule of `modules` in eval() inside the block; each one's mode restored after it."""
    modules = list(modules)
    modes = [(m, m.training) for module in modules for m in module.modules()]
    try:
        for module in modules:
            nn.Module.train(module, False)
        yield
    finally:
        for m, mode in modes:
            m.training = mode


@torch.no_grad()
def path_forward(parts: StageParts, stage: Stage, inputs: torch.Tensor) -> Any:
    """The outputs of `stage`'s training path, the committed prefix run in full (no SnapCheck)."""
    path = parts.path(stage)
    view = parts.view
    with all_in_eval(parts.all_modules()):
        h = inputs
        if stage.frozen_depth is not None:
            h = view.run(view.embed(inputs), 0, stage.frozen_depth)
        return path(h)
