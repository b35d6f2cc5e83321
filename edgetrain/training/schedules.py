"""Learning-rate schedules of the learner: the rate of step k is a pure function of k.

    Learner(model, lr=3e-3, lr_schedule="cosine", schedule_options={"warmup_steps": 10, "total_steps": 200})

Because the rate depends only on the number of steps done (which every checkpoint holds) and on the
schedule's settings (which it holds too), a resumed run takes exactly the rates of the uninterrupted one;
there is no scheduler object whose counter could be lost. Framework-free: both learners call `rate`.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable

from edgetrain.registry import EdgetrainError, Registry


class ScheduleError(EdgetrainError, ValueError):
    """A learning rate or schedule setting that cannot be used (NaN, negative, unknown name, ...)."""


@dataclass(frozen=True)
class ScheduleSettings:
    warmup_steps: int = 0       # linear ramp from lr / (warmup_steps + 1) up to lr
    total_steps: int = 0        # decaying schedules reach lr * min_lr_ratio here (and stay)
    min_lr_ratio: float = 0.0   # floor of the decay, as a fraction of lr


# name -> factor(step, settings) in [0, 1], step = steps already done (0 for the first step)
SCHEDULES: Registry[Callable[[int, ScheduleSettings], float]] = Registry("lr schedule")


def _warmup(step: int, settings: ScheduleSettings) -> float | None:
    if step < settings.warmup_steps:
        return (step + 1) / (settings.warmup_steps + 1)
    return None


def _decay_progress(step: int, settings: ScheduleSettings) -> float:
    span = max(settings.total_steps - settings.warmup_steps, 1)
    return min(max(step - settings.warmup_steps, 0) / span, 1.0)


def _constant(step: int, settings: ScheduleSettings) -> float:
    return 1.0


def _linear_warmup(step: int, settings: ScheduleSettings) -> float:
    warm = _warmup(step, settings)
    return 1.0 if warm is None else warm


def _linear(step: int, settings: ScheduleSettings) -> float:
    warm = _warmup(step, settings)
    if warm is not None:
        return warm
    floor = settings.min_lr_ratio
    return floor + (1.0 - floor) * (1.0 - _decay_progress(step, settings))


def _cosine(step: int, settings: ScheduleSettings) -> float:
    warm = _warmup(step, settings)
    if warm is not None:
        return warm
    floor = settings.min_lr_ratio
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * _decay_progress(step, settings)))


SCHEDULES.add("constant", _constant)
SCHEDULES.add("linear-warmup", _linear_warmup)  # warm-up, then constant
SCHEDULES.add("linear", _linear)                # warm-up, then linear decay to the floor
SCHEDULES.add("cosine", _cosine)                # warm-up, then cosine decay to the floor


def warmup_cosine_factor(step: int, total: int, warmup: int, floor: float) -> float:
    """The papers' warm-up and cosine (SegProp's Eq. F.1; subnetwork DP's set-up) as a multiple of the
    peak rate: a linear ramp (step + 1) / warmup that reaches the peak on the last warm-up step, then cosine
    from 1 down to `floor` at step `total` (and `floor` after it). The learner's "cosine" ramps from
    lr / (warmup + 1) instead, so that no step of its warm-up runs at the full rate."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if total <= warmup:  # no room for a cosine: here step >= warmup >= total, past the end
        return floor
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + 0.5 * (1.0 - floor) * (1.0 + math.cos(math.pi * progress))


def check_learning_rate(lr: Any, where: str = "lr") -> float:
    """A finite, non-negative float, or ScheduleError naming the value."""
    if isinstance(lr, bool) or not isinstance(lr, (int, float)):
        raise ScheduleError(f"{where} must be a number, got {lr!r}")
    value = float(lr)
    # 0 is allowed: a frozen run is a legitimate diagnostic (every update rule must then leave weights alone).
    if not math.isfinite(value) or value < 0 or value > 1e6:
        raise ScheduleError(f"{where} must be a finite number in [0, 1e6], got {lr!r}")
    return value


@dataclass(frozen=True)
class LRSchedule:
    """A named schedule with its settings; `rate(step)` is the learning rate of the step after `step` done."""

    name: str = "constant"
    settings: ScheduleSettings = ScheduleSettings()

    @classmethod
    def make(cls, name: str | None = None, options: dict[str, Any] | None = None) -> "LRSchedule":
        name = name or "constant"
        if not isinstance(name, str):
            raise ScheduleError(f"lr_schedule must be a schedule name, got {name!r}")
        SCHEDULES.get(name)
        options = dict(options or {})
        known = set(ScheduleSettings.__dataclass_fields__)
        unknown = sorted(set(options) - known)
        if unknown:
            raise ScheduleError(f"lr schedule {name!r}: unknown option(s) {', '.join(unknown)}; "
                                f"known: {', '.join(sorted(known))}")
        for key in ("warmup_steps", "total_steps"):
            value = options.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ScheduleError(f"lr schedule {name!r}: {key} must be a non-negative integer, got {value!r}")
        ratio = options.get("min_lr_ratio", 0.0)
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= float(ratio) <= 1.0:
            raise ScheduleError(f"lr schedule {name!r}: min_lr_ratio must be in [0, 1], got {ratio!r}")
        settings = ScheduleSettings(**{**options, "min_lr_ratio": float(ratio)})
        if name in ("linear", "cosine") and settings.total_steps <= settings.warmup_steps:
            raise ScheduleError(f"lr schedule {name!r} decays until total_steps, which must be above "
                                f"warmup_steps ({settings.warmup_steps}); got {settings.total_steps}")
        return cls(name, settings)

    def factor(self, step: int) -> float:
        return SCHEDULES.get(self.name)(step, self.settings)

    def rate(self, base_lr: float, step: int) -> float:
        return base_lr * self.factor(step)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **asdict(self.settings)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LRSchedule":
        options = dict(data)
        return cls.make(options.pop("name"), options)


def check_same_schedule(state: dict[str, Any], schedule: LRSchedule, base_lrs: list[float], source: str) -> None:
    """A checkpoint resumes only under the schedule and rates it was written with: a run whose rates
    changed silently would not be the run that was checkpointed. (Checkpoints from before schedules
    existed ran at a constant rate; their rate is the optimizer state's.)"""
    saved = state.get("lr_schedule", {"name": "constant", **asdict(LRSchedule().settings)})
    if saved != schedule.to_dict():
        raise EdgetrainError(f"{source} was written with lr schedule {saved}, this learner has "
                             f"{schedule.to_dict()}; resume with the same schedule, or start a new run")
    saved_lrs = state.get("base_lrs")
    if saved_lrs is not None and [float(x) for x in saved_lrs] != [float(x) for x in base_lrs]:
        raise EdgetrainError(f"{source} was written with learning rate(s) {saved_lrs}, this learner has "
                             f"{base_lrs}; resume with the same lr, or start a new run")
