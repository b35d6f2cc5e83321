"""The personaliser's history, gate by gate: what each window's candidate scored, what it had to beat, and
whether it was promoted, read back from the store's event log (no torch, no SQLite).

The `promoted` and `rejected` events are the source: together they hold every gate, rejected windows
included (the versions table keeps only what was promoted, and only the newest `keep_versions`). The log is
read as events.read_events reads it: a torn last line (a process killed mid-write) or a line that is not an
event is skipped. A gate event whose figures are missing or of the wrong type is skipped too, so a damaged
line costs one row, never the history. The rotated log (events.jsonl.1) is read first, so the history
reaches back as far as the two files do.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgetrain.personalise.errors import PersonaliseError
from edgetrain.personalise.events import read_events
from edgetrain.personalise.store import EVENTS

# The gate's metrics and their direction (edgetrain.personalise.kinds: a decoder's held-out perplexity, a
# classifier's accuracy), kept here so that reading the history does not load the trainers (torch).
HIGHER_IS_BETTER = {"perplexity": False, "accuracy": True}
GATE_EVENTS = ("promoted", "rejected")
SIDES = ("held_out", "forgetting")


class NoGateYetError(PersonaliseError):
    """The store has no gate in its event log yet: there is no history to show."""


@dataclass(frozen=True)
class GateRecord:
    """One window's gate, with the figures of its `promoted` or `rejected` event.

    value: the candidate's held-out metric; reference: its start's on the same examples (what it had to beat);
    by: how much better it was (a fraction of perplexity, or accuracy points; negative when worse); margin:
    how much better it had to be. The retain fields are None when the forgetting guard was off:
    retain (the candidate's retain-set score), retain_base (the base model's), retain_worsened (how much
    worse than the base's) and retain_margin (how much worse it was allowed to be; None: not checked).
    A window whose training failed is rejected with no figures: its value and reference are None.
    """

    window: int
    promoted: bool
    reason: str              # "" when promoted; "held_out", "forgetting", "held_out and forgetting", or why it failed
    version: int | None      # the version a promoted window became
    metric: str | None
    value: float | None
    reference: float | None
    by: float | None
    margin: float | None
    retain: float | None = None
    retain_base: float | None = None
    retain_worsened: float | None = None
    retain_margin: float | None = None
    time: float | None = None

    @property
    def higher_is_better(self) -> bool:
        return HIGHER_IS_BETTER.get(self.metric or "", False)

    @property
    def failed(self) -> tuple[str, ...]:
        """The sides of the gate a rejected window failed ("held_out", "forgetting"); () when promoted, or
        when it was rejected before it was judged (its training failed)."""
        return tuple(side for side in SIDES if side in self.reason.split(" and "))

    @property
    def needed(self) -> float | None:
        """The held-out score the candidate had to beat: its start's, moved by the margin."""
        if self.reference is None or self.margin is None:
            return None
        if self.higher_is_better:
            return self.reference + self.margin
        return self.reference * (1 - self.margin)

    @property
    def retain_limit(self) -> float | None:
        """The worst retain score the guard let through: the base's, moved by retain_margin."""
        if self.retain_base is None or self.retain_margin is None:
            return None
        if self.higher_is_better:
            return self.retain_base - self.retain_margin
        return self.retain_base * (1 + self.retain_margin)


def _number(value: Any) -> float | None:
    """A figure of the event as a float; None when absent. A figure of another type makes the event unreadable
    (ValueError): bool is refused though it is an int, since True is no score."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"not a number: {value!r}")
    return float(value)


def _whole(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"not a whole number: {value!r}")
    return value


def gate_record(event: dict[str, Any]) -> GateRecord | None:
    """The GateRecord of a `promoted` or `rejected` event; None for any other event, or for a gate event
    that cannot be read (no window number, a figure that is not a number, an unknown metric)."""
    kind = event.get("event")
    if kind not in GATE_EVENTS:
        return None
    try:
        window = _whole(event.get("window"))
        metric = event.get("metric")
        if window is None or (metric is not None and metric not in HIGHER_IS_BETTER):
            return None
        reason = event.get("reason", "") if kind == "rejected" else ""
        record = GateRecord(window=window, promoted=kind == "promoted", reason=str(reason or ""),
                            version=_whole(event.get("version")), metric=metric,
                            value=_number(event.get("value")), reference=_number(event.get("reference")),
                            by=_number(event.get("by")), margin=_number(event.get("margin")),
                            retain=_number(event.get("retain")), retain_base=_number(event.get("retain_base")),
                            retain_worsened=_number(event.get("retain_worsened")),
                            retain_margin=_number(event.get("retain_margin")), time=_number(event.get("time")))
    except ValueError:
        return None
    # A judged gate has both held-out figures; a window rejected before it was judged has neither. One
    # without the other is a damaged line.
    if (record.value is None) != (record.reference is None) or (record.promoted and record.value is None):
        return None
    return record


def event_files(store_dir: str | Path) -> list[Path]:
    """The store's event logs, oldest first: the rotated one (if any), then the current one."""
    current = Path(store_dir).expanduser() / EVENTS
    return [current.with_name(current.name + ".1"), current]


def gate_history(store_dir: str | Path) -> list[GateRecord]:
    """Every gate the store's event log holds, oldest first (empty when none has happened yet, or the
    directory holds no log)."""
    return [record for path in event_files(store_dir) for event in read_events(path)
            if (record := gate_record(event)) is not None]


def require_history(store_dir: str | Path) -> list[GateRecord]:
    """gate_history(store_dir), or NoGateYetError when it is empty: a picture of nothing is easy to take
    for a broken one."""
    rows = gate_history(store_dir)
    if not rows:
        directory = Path(store_dir).expanduser()
        where = "no event log" if not any(path.is_file() for path in event_files(directory)) else \
            "no promoted or rejected window in its event log"
        raise NoGateYetError(f"store {directory} has no gate yet ({where}): the history begins when the first "
                             "window ends (`edgetrain personalise run`)")
    return rows
