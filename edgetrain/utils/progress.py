"""Progress bars for long loops (fit, the CLI's train and profile, the benchmarks): tqdm on an interactive
terminal, nothing otherwise. Step lines still go to the "edgetrain" logger, printed above the bar.

Work that is no loop the caller sees (loading a model, lowering an ExecuTorch program: minutes inside ExecuTorch's
calls) goes through `stage_progress`: a line as each stage begins, and a heartbeat thread that writes a line (the
stage, the time, an estimate of what is left) whenever no edgetrain line was written for HEARTBEAT_EVERY_S
seconds. Every CLI command runs inside one (edgetrain.cli.main), so that none is silent for ten seconds; a
command names its stages with begin_stage. On a terminal a progress bar keeps time instead of heartbeat lines.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from edgetrain.utils.logs import ROOT_LOGGER

# A line at least this often (in seconds) while a stage runs: the CLI's promise is never ten seconds of silence.
HEARTBEAT_EVERY_S = 8.0
# How often the heartbeat thread looks at the clock; with the above, the longest silence is about 8.5 s.
HEARTBEAT_TICK_S = 0.5
# No estimate of what is left before the finished stages hold this share of the total: a small first stage is mostly
# fixed cost (a 1-node embedding method took 5 s to lower, the 173-node block forward 65 s), and its pace promised
# an hour for a 6-minute export.
ESTIMATE_AFTER_SHARE = 0.1

# The bars on the terminal now, innermost last: while one is, it keeps time and the heartbeat only redraws it.
_VISIBLE_BARS: list[Any] = []
# The pieces of work in progress (stage_progress), innermost last: its heartbeat is the one that speaks, and
# begin_stage / note_stage speak of it.
_OPEN: list[Stages] = []


class NoBar:
    """What a disabled bar is: every call does nothing."""

    def update(self, count: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        pass


@contextmanager
def progress_bar(total: int, *, description: str, enabled: bool = True, initial: int = 0,
                 unit: str = "step") -> Iterator[Any]:
    """A tqdm bar of `total` units when `enabled` and stderr is a terminal (tqdm's disable=None), else a
    NoBar. While it is open, records of the edgetrain loggers are written above it instead of through it."""
    if not enabled:
        yield NoBar()
        return
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    with ExitStack() as stack:
        bar = stack.enter_context(tqdm(total=total, initial=initial, desc=description, unit=unit, disable=None,
                                       file=sys.stderr, dynamic_ncols=True, leave=True))
        if not bar.disable:
            # Only loggers that already print to the console: redirecting one without a handler would give it
            # one, and a record would then print twice (there and through the root logger's handler).
            printing = [logger for logger in (logging.getLogger(ROOT_LOGGER), logging.getLogger())
                        if any(_prints_to_console(handler) for handler in logger.handlers)]
            if printing:
                stack.enter_context(logging_redirect_tqdm(loggers=printing))
            _VISIBLE_BARS.append(bar)
            stack.callback(_VISIBLE_BARS.remove, bar)
        yield bar


def _prints_to_console(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) in (sys.stdout, sys.stderr)


def progress_shown() -> bool:
    """Whether progress is shown: the "edgetrain" logger prints INFO (the CLI without --quiet; a library user's
    logging.basicConfig(level=logging.INFO))."""
    return logging.getLogger(ROOT_LOGGER).isEnabledFor(logging.INFO)


def clock_text(seconds: float) -> str:
    """7 s, 2:05 or 1:02:05: a duration as a person reads it on a progress line."""
    seconds = max(int(round(seconds)), 0)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


class Stages:
    """The stages of one piece of work (stage_progress yields it). Each stage may carry a size in units of the
    work's total (a method's graph nodes); the time the finished sized stages took, per unit, estimates the rest."""

    def __init__(self, description: str, total: float, unit: str, logger: logging.Logger) -> None:
        self.description, self.total, self.unit = description, total, unit
        self._logger = logger
        self._bar: Any = NoBar()
        self._lock = threading.Lock()
        self._started = self.last_line = time.monotonic()
        self._stage: str | None = None
        self._note = ""
        self._stage_size = 0.0
        self._stage_started = self._started
        self._done = 0.0            # units of the finished sized stages
        self._done_seconds = 0.0    # the time those stages took

    def show_on(self, bar: Any) -> None:
        """Count the finished sized stages on `bar` (a progress_bar of the total) too."""
        self._bar = bar

    def begin(self, stage: str, size: float = 0.0, *, say: bool = True) -> None:
        """End the stage running (if any) and begin `stage`, `size` units of the total; a line says so, unless the
        caller writes one of its own (`say=False`)."""
        with self._lock:
            now = time.monotonic()
            self._finish_stage(now)
            self._stage, self._stage_size, self._stage_started, self._note = stage, size, now, ""
            self._bar.set_postfix_str(stage)
            if say:
                self._say(f"{stage}: {size:,.0f} {self.unit}{'' if size == 1 else 's'}" if size else stage, now)

    def note(self, text: str) -> None:
        """Where the running stage is (`step 12 of 40`): said by the next heartbeat line, not now."""
        self._note = text

    def beat(self) -> None:
        """The heartbeat's look at the clock: a line on the work when no edgetrain line was written for
        HEARTBEAT_EVERY_S seconds, or, while a progress bar is on the terminal, that bar redrawn (its clock)."""
        with self._lock:
            now = time.monotonic()
            if now - self.last_line < HEARTBEAT_EVERY_S or _OPEN[-1:] != [self]:  # the innermost work speaks
                return
            bars = list(_VISIBLE_BARS)
            if bars:
                bars[-1].refresh()
                self.last_line = now
            else:
                self._say(self._heartbeat_text(now), now)

    def finish(self, say: bool = True) -> None:
        """End the last stage and (`say`) how long the whole took."""
        with self._lock:
            now = time.monotonic()
            self._finish_stage(now)
            self._stage = None
            self.last_line = now  # no heartbeat between this and the thread's end
            if say:
                self._say(f"done in {clock_text(now - self._started)}", now)

    def _finish_stage(self, now: float) -> None:
        if self._stage is not None and self._stage_size:
            self._done += self._stage_size
            self._done_seconds += now - self._stage_started
            self._bar.update(int(self._stage_size))

    def _heartbeat_text(self, now: float) -> str:
        """`block_backward (3 of 5): 0:40 (1:20 in all), 1,234 of 3,456 graph nodes done, about 2:10 left`: the
        stage and its note, the time on it, then what is known of the rest; `still working, 0:16 so far` before
        any stage."""
        if self._stage is None:
            return f"still working, {clock_text(now - self._started)} so far"
        note = f", {self._note}" if self._note else ""
        parts = [f"{self._stage}{note}: {clock_text(now - self._stage_started)} "
                 f"({clock_text(now - self._started)} in all)"]
        if self.total:
            parts.append(f"{self._done:,.0f} of {self.total:,.0f} {self.unit}s done")
        if self.total and self._done >= ESTIMATE_AFTER_SHARE * self.total:
            # What is left at the pace of the finished stages, less what the running one has had already.
            left = self._done_seconds / self._done * (self.total - self._done)
            if self._stage_size:
                left -= now - self._stage_started
            if left >= 1:
                parts.append(f"about {clock_text(left)} left")
        return ", ".join(parts)

    def _say(self, text: str, now: float) -> None:
        self._logger.info("%s: %s", self.description, text)
        self.last_line = now


class NoStages:
    """What disabled stage progress is: every call does nothing."""

    def begin(self, stage: str, size: float = 0.0, *, say: bool = True) -> None:
        pass

    def note(self, text: str) -> None:
        pass


class _Activity(logging.Handler):
    """Notes when an edgetrain line was last written (a step line, a nested piece of work's): silence is what the
    heartbeat breaks, not the absence of its own lines."""

    def __init__(self, stages: Stages) -> None:
        super().__init__(logging.INFO)
        self.stages = stages

    def emit(self, record: logging.LogRecord) -> None:
        self.stages.last_line = time.monotonic()


@contextmanager
def stage_progress(description: str, total: float = 0.0, *, unit: str = "unit", logger: logging.Logger | None = None,
                   enabled: bool | None = None, say_done: bool = True) -> Iterator[Stages | NoStages]:
    """Report long work in stages (Stages.begin) as INFO lines of `logger` ("<description>: <stage>"), kept alive by
    a heartbeat thread; `total` units (summed over the stages' sizes) give a bar on a terminal and an estimate of
    what is left. A last line says how long it took (`say_done`). `enabled` defaults to progress_shown():
    nothing, not even the thread, when no one would see it."""
    if not (progress_shown() if enabled is None else enabled):
        yield NoStages()
        return
    root = logging.getLogger(ROOT_LOGGER)
    stages = Stages(description, total, unit, logger or root)
    activity = _Activity(stages)
    stopped = threading.Event()
    heartbeat = threading.Thread(target=_beat_until, args=(stages, stopped), name="edgetrain-heartbeat", daemon=True)
    with progress_bar(int(total), description=description, unit=unit, enabled=bool(total)) as bar:
        stages.show_on(bar)
        root.addHandler(activity)
        _OPEN.append(stages)
        heartbeat.start()
        try:
            yield stages
            stages.finish(say=say_done)
        finally:
            stopped.set()
            heartbeat.join()
            _OPEN.remove(stages)
            root.removeHandler(activity)


def _beat_until(stages: Stages, stopped: threading.Event) -> None:
    while not stopped.wait(HEARTBEAT_TICK_S):
        stages.beat()


def begin_stage(stage: str, size: float = 0.0, *, say: bool = True) -> None:
    """Stages.begin on the innermost stage_progress open (an `edgetrain` command's), if any: how a command names
    what it is doing (`loading smollm2-135m`) without passing its progress around."""
    if _OPEN:
        _OPEN[-1].begin(stage, size, say=say)


def note_stage(text: str) -> None:
    """Stages.note on the innermost stage_progress open, if any."""
    if _OPEN:
        _OPEN[-1].note(text)
