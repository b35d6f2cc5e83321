"""A fake clock for edgetrain.utils.progress, and a stream that notes when each line was written on it: what the
tests of "never ten seconds without a line" (docs/cli.md) measure with."""
from __future__ import annotations

import io
import threading
import time


class FakeClock:
    """Stands in for the `time` module of edgetrain.utils.progress: the real monotonic clock plus the seconds the
    slowed work added (pass_seconds). It adds them one at a time and, after each, waits until every heartbeat thread
    has read the clock (none runs under --quiet), so that a heartbeat sees every second as a real one would,
    however busy the machine."""

    def __init__(self) -> None:
        self.added = 0.0
        self._seen: dict[int, float] = {}  # heartbeat thread -> the largest `added` a read of it has included
        self._read = threading.Condition()

    def monotonic(self) -> float:
        with self._read:
            if threading.current_thread().name == "edgetrain-heartbeat":
                self._seen[threading.get_ident()] = self.added
                self._read.notify_all()
            return time.monotonic() + self.added

    def pass_seconds(self, seconds: int) -> None:
        for _ in range(seconds):
            with self._read:
                self.added += 1.0
                if not self._read.wait_for(self._all_heartbeats_saw_it, timeout=30):
                    raise AssertionError("a heartbeat thread did not read the clock for 30 s")

    def _all_heartbeats_saw_it(self) -> bool:
        # Every heartbeat running (one for each piece of work in progress, nested ones too; none under --quiet).
        return all(self._seen.get(thread.ident, -1.0) >= self.added for thread in threading.enumerate()
                   if thread.name == "edgetrain-heartbeat" and thread.is_alive())


class StampedStream(io.StringIO):
    """A text stream that notes the fake time of each line written on it (stdout or stderr of a command)."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock
        self.lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            now = time.monotonic() + self.clock.added  # not clock.monotonic(): a read of ours is no heartbeat's
            self.lines += [(now, line) for line in text.splitlines() if line.strip()]
            return super().write(text)


def longest_silence(start: float, end: float, *streams: StampedStream) -> float:
    """The longest time between `start`, the lines written on `streams` and `end` (seconds of the fake clock)."""
    times = sorted([start, end, *(when for stream in streams for when, _ in stream.lines)])
    return max(later - earlier for earlier, later in zip(times, times[1:]))
