"""The clock of a staged schedule: how long each stage lasts (a step budget, or less on a loss
plateau), where the run stands, and the learning-rate multipliers of the segment and of the global head
(SegProp appendix F). Plain numbers only; the trainer applies them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from edgetrain.registry import EdgetrainError
from edgetrain.training.schedules import warmup_cosine_factor

LR_SCHEDULES = ("constant", "cosine")


# SegProp's Eq. F.1 as a multiplier of the peak rate (shared with subnetwork DP: edgetrain.training.schedules).
cosine_multiplier = warmup_cosine_factor


def stage_budgets(name: str, steps: int | Sequence[int] | None, count: int) -> list[int | None]:
    """Steps of each of `count` stages: one number for all, one per stage, or None (no budget)."""
    if steps is None:
        return [None] * count
    if isinstance(steps, (int, float)) and not isinstance(steps, bool):
        budgets = [int(steps)] * count
    else:
        budgets = [int(s) for s in steps]
        if len(budgets) != count:
            raise EdgetrainError(f"{name}: steps_per_stage has {len(budgets)} entries for {count} stages")
    if any(b < 1 for b in budgets):
        raise EdgetrainError(f"{name}: steps_per_stage must be >= 1, got {budgets}")
    return budgets


@dataclass
class Plateau:
    """Ends a stage when the mean training loss of `window` steps has not improved by a relative
    `min_delta` for `patience` windows in a row (window 0: never). `state` is the checkpointed part:
    [best window mean, bad windows, window sum, window count]."""
    window: int = 0
    patience: int = 0
    min_delta: float = 1e-3
    state: list[Any] = field(default_factory=lambda: [None, 0, 0.0, 0])

    def reached(self, loss: float) -> bool:
        if self.window == 0:
            return False
        state = self.state
        state[2] += loss
        state[3] += 1
        if state[3] < self.window:
            return False
        mean = state[2] / state[3]
        state[2], state[3] = 0.0, 0
        if state[0] is None or mean < state[0] * (1 - self.min_delta):
            state[0], state[1] = mean, 0
            return False
        state[1] += 1
        return state[1] >= self.patience

    def reset(self) -> None:
        self.state = [None, 0, 0.0, 0]

    def load(self, state: Sequence[Any]) -> None:
        self.state = [state[0], int(state[1]), float(state[2]), int(state[3])]


@dataclass
class StageClock:
    """Stage index, steps done in the stage and in the whole schedule, and the rates they give."""
    budgets: list[int | None]
    plateau: Plateau
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    head_lr_scale: float = 1.0
    stage_index: int = 0
    stage_step: int = 0
    total_step: int = 0
    finished: bool = False

    @property
    def total_budget(self) -> int | None:
        return None if any(b is None for b in self.budgets) else sum(self.budgets)  # type: ignore[arg-type]

    def lr_multipliers(self) -> tuple[float, float]:
        """(segment, global head) multipliers of the optimizer's lr at the current step: the segment
        follows a cosine over its own stage, the head one cosine over the whole schedule."""
        if self.lr_schedule == "constant":
            return 1.0, self.head_lr_scale
        budget = self.budgets[self.stage_index]
        assert budget is not None and self.total_budget is not None
        segment = cosine_multiplier(self.stage_step, budget, self.warmup_steps, self.min_lr_ratio)
        head = cosine_multiplier(self.total_step, self.total_budget, self.warmup_steps, self.min_lr_ratio)
        return segment, head * self.head_lr_scale

    def tick(self, loss: float) -> bool:
        """Count one step with its (rank-mean) loss; True when the stage is over."""
        self.stage_step += 1
        self.total_step += 1
        return self.plateau.reached(loss) or self.stage_step == self.budgets[self.stage_index]

    def next_stage(self) -> bool:
        """Move to the next stage; after the last one only `finished` is set (and False returned)."""
        if self.stage_index + 1 >= len(self.budgets):
            self.finished = True
            return False
        self.stage_index += 1
        self.stage_step = 0
        self.plateau.reset()
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"stage": self.stage_index, "stage_step": self.stage_step, "total_step": self.total_step,
                "finished": self.finished, "plateau": list(self.plateau.state)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stage_index = int(state["stage"])
        self.stage_step = int(state["stage_step"])
        self.total_step = int(state["total_step"])
        self.finished = bool(state.get("finished", False))
        self.plateau.load(list(state.get("plateau", [None, 0, 0.0, 0])))


def make_clock(name: str, count: int, steps_per_stage: int | Sequence[int] | None, plateau_window: int,
               plateau_patience: int, plateau_min_delta: float, lr_schedule: str, warmup_steps: int,
               min_lr_ratio: float, head_lr_scale: float) -> StageClock:
    """The clock of `count` stages from the trainer's options (StagedTrainer's docstring), checked."""
    budgets = stage_budgets(name, steps_per_stage, count)
    if lr_schedule not in LR_SCHEDULES:
        raise EdgetrainError(f"{name}: unknown lr_schedule {lr_schedule!r}; known: {', '.join(LR_SCHEDULES)}")
    if lr_schedule == "cosine" and any(b is None for b in budgets):
        raise EdgetrainError(f"{name}: lr_schedule='cosine' needs steps_per_stage (the length of each cosine)")
    if plateau_window < 0 or plateau_patience < 0 or (plateau_window > 0) != (plateau_patience > 0):
        raise EdgetrainError(f"{name}: plateau_window and plateau_patience go together (both > 0)")
    return StageClock(budgets, Plateau(int(plateau_window), int(plateau_patience), float(plateau_min_delta)),
                      lr_schedule, int(warmup_steps), float(min_lr_ratio), float(head_lr_scale))
