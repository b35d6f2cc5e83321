"""The Learner's first-step memory-budget guard: measure the first step, refuse it (undone) when what it
adds does not fit beside the weights, or fall back to an allowed lower-memory method.

Plain functions over the learner they guard (any framework's: what touches tensors goes through its
engine), reached through the learner's public surface (GuardedLearner below), so learner.py keeps only
the streaming interface and calls first_step_within_budget from its step.
"""
from __future__ import annotations

import copy
from typing import Any, Protocol

from edgetrain.data.batch import Batch
from edgetrain.methods.base import TrainingError
from edgetrain.probes.base import settle_memory
from edgetrain.registry import EdgetrainError
from edgetrain.training.budget_report import StepFigure, lower_memory_methods, rank_methods, refusal_message
from edgetrain.training.memory_estimate import first_slice_over_budget
from edgetrain.training.stats import StepStats
from edgetrain.training.step_estimates import estimate_step_bytes
from edgetrain.utils.logs import get_logger
from edgetrain.utils.memory_sizes import parse_bytes

# The learner's own logger: these messages read as the learner's, as they did before the move.
log = get_logger("edgetrain.training.learner")

# Lower-memory methods to fall back to, best first (exact gradients before estimates).
FALLBACK_ORDER = ("mebp", "mesp", "mezo")


class MemoryBudgetError(TrainingError):
    """The measured first step does not fit the memory budget."""


class GuardedLearner(Protocol):
    """What the guard reads and calls on the learner it guards (edgetrain.Learner)."""

    model: Any
    engine: Any
    optimizer: Any
    method: Any
    method_name: str
    method_options: dict[str, Any]
    methods: Any                       # the registry of methods its framework runs
    fallback_methods: tuple[str, ...]
    memory_budget: int | None
    memory_budget_origin: str
    budget_probe: Any                  # what measures a step against the budget
    budget_checked: bool               # whether the first step has passed the guard
    steps_done: int
    stream_position: int

    @property
    def weights_bytes(self) -> int: ...
    def snapshot(self) -> Any: ...
    def restore_snapshot(self, snapshot: Any) -> None: ...
    def side_state(self) -> Any: ...
    def restore_side_state(self, side_state: Any) -> None: ...
    def use_method(self, name: str) -> None: ...
    def step(self, batch: Batch) -> StepStats: ...
    def step_measured_by(self, probe: Any, batch: Batch) -> StepStats: ...


def resolve_memory_budget(memory_budget: int | str | None, target: str | None) -> tuple[int | None, str]:
    """(budget in bytes or None, where it came from for messages). An explicit `memory_budget` overrides
    the device profile's; the profile is still loaded, so an unknown target is an error either way."""
    profile = None
    if target is not None:
        from edgetrain.targets import load_target

        profile = load_target(target)
    if memory_budget is not None:
        return parse_bytes(memory_budget), ""
    if profile is not None:
        return profile.memory_budget_bytes, f" of target {profile.name!r}"
    return None, ""


def first_step_within_budget(learner: GuardedLearner, batch: Batch) -> StepStats:
    """Measure the first step; refuse it, undone, when the memory it adds does not fit what the budget
    leaves beside the weights (or switch to the next allowed method and measure again).

    What is charged. The budget is the device's allowance for one training process (a device
    profile's memory_budget_mib: "weights included, leaving room for the OS and the app"). Training
    holds two things in it: the weights, and what a step adds while it runs.
    - The weights are charged once, at their full size (parameters and buffers), however they are
      held: in the process's own memory, or memory-mapped from the checkpoint (safetensors), resident
      or not yet read. The first forward reads all of them, so a device that trains must hold them.
    - The step is charged what it adds above the memory held before it (StepStats.peak_bytes;
      edgetrain/training/step_memory.py). Pages the step maps in from the weights' file are not step memory:
      charging them too counted memory-mapped weights twice and refused steps that fit.
    - What the process held before the weights -- the interpreter, torch's libraries, allocator
      caches -- is not charged: it is the app's share of the device, the same whichever method runs,
      and charging it would make one budget mean different things in a notebook and in a lean script
      (and in the exported runtime a phone runs).
    So a step is refused when weights + what it adds > budget: when what it adds does not fit what
    the budget leaves beside the weights. The refusal ranks the methods by the memory their step adds
    (measured where they ran, estimated from the model's shape where not: edgetrain/training/step_estimates.py)."""
    tried: list[StepFigure] = []
    while True:
        over = first_slice_over_budget(lambda part: measure_undone_step(learner, part), batch,
                                       learner.weights_bytes, learner.memory_budget)
        if over is not None:
            tried.append(StepFigure(learner.method_name, over.needed_bytes - learner.weights_bytes, measured=True,
                                    slice_tokens=over.slice_tokens, batch_tokens=over.batch_tokens))
        else:
            snapshot = learner.snapshot()
            learner.budget_checked = True
            settle_memory()
            stats = learner.step_measured_by(learner.budget_probe, batch)
            added = stats.peak_bytes or 0
            if learner.weights_bytes + added <= learner.memory_budget:
                return stats
            learner.restore_snapshot(snapshot)
            learner.steps_done -= 1
            tried.append(StepFigure(learner.method_name, added, measured=True))
        candidates = [m for m in learner.fallback_methods if m not in {figure.method for figure in tried}]
        if not candidates:
            raise MemoryBudgetError(budget_message(learner, batch, learner.budget_probe.name, tried))
        learner.use_method(candidates[0])
        log.warning("%s adds more than the %s MiB the budget leaves beside the weights; falling back to %s",
                    tried[-1].describe(), f"{max(0, learner.memory_budget - learner.weights_bytes) / 2**20:,.1f}",
                    learner.method_name)
        learner.budget_checked = False


def measure_undone_step(learner: GuardedLearner, batch: Batch) -> int | None:
    """What one step on `batch` adds (StepStats.peak_bytes), measured by the budget probe, then undone
    entirely: weights, optimizer and method state, RNG, running statistics and counters are as before.
    None when the step cannot run on this batch (the full step will then say why)."""
    snapshot, side_state = learner.snapshot(), learner.side_state()
    method_state = copy.deepcopy(learner.method.state_dict())
    counters = (learner.steps_done, learner.stream_position)
    settle_memory()
    try:
        return learner.step_measured_by(learner.budget_probe, batch).peak_bytes
    except EdgetrainError:
        return None
    finally:
        learner.restore_snapshot(snapshot)
        learner.restore_side_state(side_state)
        learner.method.load_state_dict(method_state)
        learner.steps_done, learner.stream_position = counters
        learner.engine.clear_gradients(learner.optimizer)


def budget_message(learner: GuardedLearner, batch: Batch, probe_name: str, tried: list[StepFigure]) -> str:
    """The refusal: the methods tried, ranked against the others' estimates, and what to try instead."""
    candidates = {*FALLBACK_ORDER, "bp", *(figure.method for figure in tried)}
    estimates = {name: estimate_step_bytes(learner.model, batch, name,
                                           learner.method_options if name == learner.method_name else None)
                 for name in sorted(candidates) if name in learner.methods}
    ranked = rank_methods(tried, estimates)
    suggestions = []
    lower = lower_memory_methods(tried, ranked, FALLBACK_ORDER, learner.methods.names())
    if lower:
        suggestions.append(f"a lower-memory method ({', '.join(lower)}; allow it with fallback_methods=)")
    if batch.inputs.dim() >= 2 and getattr(learner.model, "task", None) == "lm":
        suggestions.append(f"a shorter sequence (now {batch.inputs.shape[1]})")
    if batch.num_samples > 1:
        suggestions.append(f"a smaller batch (now {batch.num_samples})")
    config = getattr(learner.model, "lora_config", None)
    if config is not None:
        suggestions.append(f"a smaller LoRA rank (now {config.rank})")
    return refusal_message(tried, ranked, weights_bytes=learner.weights_bytes, budget_bytes=learner.memory_budget,
                           budget_origin=learner.memory_budget_origin, probe_name=probe_name,
                           suggestions=suggestions)
