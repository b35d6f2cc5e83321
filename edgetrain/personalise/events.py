"""What the personaliser did, as events: each goes to the app's callback and to a JSON Lines log.

An event is a dict with "event" (its type), "time" (seconds since the epoch) and its own fields. Types:

- step: one training step (step in the window, window, loss, seconds, peak_bytes)
- window: a training window began (window, start: the version it starts from or "base", train and
  held_out examples, reference metric)
- checkpoint: the window's training state was written (step, path)
- evaluated: a candidate was evaluated on the held-out examples (metric, value, reference)
- promoted / rejected: the gate's decision (version, metric, value, reference, by: how much better or worse)
- paused: training stopped for now (reason: "app" for pause(), else what the policy read); resumed: it
  goes on (after: the reason it had paused for); window_resumed: a run goes on with the window a previous
  run checkpointed (window, step); window_abandoned: forget() or rollback() made the open window moot
- waiting: there is not enough to train on yet (reason)
- stopped: run() returned (reason: "stop", "max_steps", "max_seconds", "policy", "waiting")
- examples_dropped: the retention cap removed the oldest examples (ids, count, bytes)
- forgotten: forget() deleted examples (ids); stale: versions that saw them (versions)
- rollback: the promoted version changed back (from, to)
- skipped_example: an example the model cannot train on was left out of a window (id, reason)
- version_damaged: a stored version failed its checksum and is no longer served (version)

The log is appended one line per write(2) to a file opened for appending, so a process killed at any
moment leaves whole lines (at worst the last one missing); a full disk is a DiskFullError naming the log,
with the part of the line that was written cut off again; past `rotate_bytes` the file is renamed to
`events.jsonl.1` (replacing the previous one) and a new one begins.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable

from edgetrain.files.space import disk_full_error, is_disk_full
from edgetrain.utils.logs import get_logger

log = get_logger(__name__)

EventCallback = Callable[[dict[str, Any]], object]
ROTATE_BYTES = 8 * 2**20


class EventLog:
    """Appends events to `path` and hands each to `callback` (an exception in the callback is logged as a
    warning, never raised into training)."""

    def __init__(self, path: str | Path, callback: EventCallback | None = None,
                 rotate_bytes: int = ROTATE_BYTES) -> None:
        self.path = Path(path)
        self.callback = callback
        self.rotate_bytes = rotate_bytes

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, "time": round(time.time(), 6), **fields}
        self._append(record)
        if self.callback is not None:
            try:
                self.callback(dict(record))
            except Exception as exc:  # noqa: BLE001 -- the app's code: report it, keep training
                log.warning("the personaliser's event callback raised %r on a %s event", exc, event)
        return record

    def _append(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, default=str) + "\n").encode("utf-8")
        try:
            if self.path.stat().st_size + len(line) > self.rotate_bytes:
                os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot rotate the event log %s (%s)", self.path, exc)
        try:
            descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as exc:
            if is_disk_full(exc):
                raise disk_full_error(self.path, len(line), "the event log") from None
            log.warning("cannot write the event log %s (%s); the event was %s", self.path, exc, record["event"])
            return
        try:
            start = os.fstat(descriptor).st_size
            try:
                written = os.write(descriptor, line)
            except OSError as exc:
                if not is_disk_full(exc):
                    raise
                written = -1
            if written != len(line):  # a full disk: what came out is cut back, so the log stays whole lines
                _cut_back(descriptor, start, max(written, 0))
                raise disk_full_error(self.path, len(line), "the event log")
        finally:
            os.close(descriptor)


def _cut_back(descriptor: int, start: int, written: int) -> None:
    """Remove the `written` bytes of a torn line appended at `start`, unless another writer appended since
    (its line is not ours to cut: read_events skips a torn line anyway)."""
    try:
        if os.fstat(descriptor).st_size == start + written:
            os.ftruncate(descriptor, start)
    except OSError:
        pass


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """The events in a log, oldest first (a torn last line, from a process killed mid-write, is skipped)."""
    events = []
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    for line in text.splitlines():
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            events.append(value)
    return events
