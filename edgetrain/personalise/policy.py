"""When the device can afford to train: limits on power, temperature, memory headroom and idleness.

Each limit is optional; a Policy() with no arguments checks only memory (a step must fit in what is free).

- require_power: train only on external power (a plugged-in battery, or a device without one that says so)
- max_temp_c: train only while the hottest sensor reads below this
- min_free_bytes: train only while free memory minus the step's need is at least this (0: the step must
  fit; None: memory is not checked). The step's need is what the learner measured on its last steps, or,
  before the first, edgetrain's estimate for the method (edgetrain.training.step_estimates); unknown before either.
- require_idle: train only while the app has declared itself idle (Personaliser.set_idle(True))

A reading that is unknown (no battery, no sensors, the app never declared idleness, no measurement of the
step yet) follows `unknown`: "allow" (the default: a desktop without a battery or sensors still trains) or
"deny" (a cautious app trains only on what it can see). The decision lists which readings were unknown.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edgetrain.personalise.errors import PersonaliseError
from edgetrain.personalise.sensors import Readings

UNKNOWN_CHOICES = ("allow", "deny")
MiB = 2**20


@dataclass(frozen=True)
class Decision:
    """Whether to train now; `reasons` says why not (empty when allowed), `unknown` which readings were."""

    allowed: bool
    reasons: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()
    readings: Readings = field(default_factory=Readings)
    need_bytes: int | None = None

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)

    def to_dict(self) -> dict[str, Any]:
        return {"allowed": self.allowed, "reasons": list(self.reasons), "unknown": list(self.unknown),
                "readings": self.readings.to_dict(), "need_bytes": self.need_bytes}


@dataclass(frozen=True)
class Policy:
    require_power: bool = False
    max_temp_c: float | None = None
    min_free_bytes: int | None = 0
    require_idle: bool = False
    unknown: str = "allow"
    check_every_s: float = 1.0  # how often a run reads the sensors (the idle flag and pause() are seen every step)

    def __post_init__(self) -> None:
        if self.unknown not in UNKNOWN_CHOICES:
            raise PersonaliseError(f"Policy(unknown=...) must be 'allow' or 'deny', got {self.unknown!r}")
        if self.max_temp_c is not None and not isinstance(self.max_temp_c, (int, float)):
            raise PersonaliseError(f"max_temp_c must be a number of degrees Celsius, got {self.max_temp_c!r}")
        if self.min_free_bytes is not None and (not isinstance(self.min_free_bytes, int) or self.min_free_bytes < 0):
            raise PersonaliseError(f"min_free_bytes must be a whole number >= 0 or None, got {self.min_free_bytes!r}")
        if not isinstance(self.check_every_s, (int, float)) or self.check_every_s < 0:
            raise PersonaliseError(f"check_every_s must be a number >= 0, got {self.check_every_s!r}")

    def decide(self, readings: Readings, *, idle: bool | None = None, need_bytes: int | None = None) -> Decision:
        """Whether the limits allow training, given the readings, the app's idle flag (None: never declared)
        and the step's memory need (None: not known yet)."""
        reasons: list[str] = []
        unknown: list[str] = []

        def check(name: str, value: Any, ok: bool, why_not: str) -> None:
            if value is None:
                unknown.append(name)
                if self.unknown == "deny":
                    note = readings.notes.get(name, "")
                    reasons.append(f"{name} unknown{f' ({note})' if note else ''} and unknown readings deny training")
            elif not ok:
                reasons.append(why_not)

        if self.require_power:
            check("on_power", readings.on_power, bool(readings.on_power), "on battery")
        if self.max_temp_c is not None:
            temperature = readings.temperature_c
            check("temperature_c", temperature, temperature is not None and temperature < self.max_temp_c,
                  f"temperature {temperature} C at or above the limit {self.max_temp_c:g} C")
        if self.min_free_bytes is not None:
            available = readings.available_bytes
            if available is None or need_bytes is None:
                check("available_bytes" if available is None else "step_need_bytes", None, True, "")
            else:
                left = available - need_bytes
                check("available_bytes", available, left >= self.min_free_bytes,
                      f"memory: {available / MiB:,.0f} MiB free, the step needs {need_bytes / MiB:,.0f} MiB "
                      f"and {self.min_free_bytes / MiB:,.0f} MiB must stay free")
        if self.require_idle:
            check("idle", idle, bool(idle), "the app is not idle")
        return Decision(not reasons, tuple(reasons), tuple(unknown), readings, need_bytes)
