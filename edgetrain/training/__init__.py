"""The Learner and its parts, written once for every framework.

    learner.py          Learner: feed a batch, take a step, read stats (StepStats, stats.py)
    engine.py           the Engine protocol: what one framework does with tensors (backends/*/engine.py)
    fit_loop.py         the stream loop behind Learner.fit
    budget_guard.py     the first-step memory-budget guard, with budget_report.py (its refusal),
                        memory_estimate.py (refusing on a slice) and step_estimates.py (a step's memory
                        from the model's shape)
    step_memory.py      what a step adds to the process's memory (StepStats.peak_bytes)
    gradient_steps.py   accumulation and clipping
    schedules.py        learning-rate schedules
    checkpoint.py       checksummed, rotating checkpoints
    losses.py, precision.py   the task losses and the dtype reductions are computed in

The names below are imported on first use (PEP 562): `edgetrain.training.losses` and the other parts are
read by models, methods and data without importing the learner.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from edgetrain.utils.lazy import lazy_exports

_LAZY = {"Learner": "edgetrain.training.learner", "StepStats": "edgetrain.training.stats",
         "MemoryBudgetError": "edgetrain.training.budget_guard"}

if TYPE_CHECKING:
    from edgetrain.training.budget_guard import MemoryBudgetError
    from edgetrain.training.learner import Learner
    from edgetrain.training.stats import StepStats


__getattr__ = lazy_exports(__name__, _LAZY, globals())

__all__ = ["Learner", "MemoryBudgetError", "StepStats"]
