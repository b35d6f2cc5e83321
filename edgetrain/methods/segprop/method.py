"""Registrations: `segprop` (Segmented Propagation with a persistent global head) and `lw` (layer-wise
training with per-stage auxiliary classifiers and a final head-only stage). `e2e` is `bp`.

With the Learner one `step` is one step of the current stage; the stage advances by itself after
`steps_per_stage` steps (or on a plateau), and the stage, its step count and the plateau tracker are
in the checkpoint, so a resumed run continues exactly:

    learner = Learner(model, method="segprop", optimizer="adamw", lr=1e-3,
                      method_options={"head_blocks": 1, "segments": 3, "steps_per_stage": 500})
    learner.fit(stream, max_steps=learner.method.total_budget)
    model = learner.method.finish()      # adapters discarded; plain forward

`run_schedule` (edgetrain/recipes/segprop_schedule.py) does the same over a stream with epochs per stage, evaluation per stage
and checkpoint/resume.
"""
from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from edgetrain.methods.base import METHODS
from edgetrain.methods.segprop.trainer import StagedTrainer
from edgetrain.registry import EdgetrainError

OPTIONS = tuple(name for name in inspect.signature(StagedTrainer.__init__).parameters
                if name not in ("self", "name", "model"))


def _check_options(name: str, options: dict[str, Any]) -> None:
    # A misspelt option would otherwise be a bare TypeError from the constructor.
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise EdgetrainError(f"{name}: unknown method option(s) {', '.join(unknown)}; "
                             f"known: {', '.join(OPTIONS)}")


def segprop(model: nn.Module, **options: Any) -> StagedTrainer:
    _check_options("segprop", options)
    return StagedTrainer("segprop", model, **options)


def layer_wise(model: nn.Module, **options: Any) -> StagedTrainer:
    _check_options("lw", options)
    return StagedTrainer("lw", model, **options)


METHODS.add("segprop", segprop)
METHODS.add("lw", layer_wise)
