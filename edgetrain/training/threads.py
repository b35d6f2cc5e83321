"""Intra-op threads that fit the cores the device has free.

On a phone or a Jetson, training shares the cores with the app. torch's intra-op workers wait on each other
at every parallel kernel, so one worker on a core the app holds stalls them all: a `mesp` LoRA step measured
43x slower with 2 threads than with 1 while another process held one of this machine's 2 cores. A learner
made with `threads="auto"` counts, between steps and without pausing, how many cores everyone else kept busy
since the last check (the system's busy CPU time less this process's own, both cumulative counters, so
nothing waits for a sampling interval; only the first check samples 0.1 s), and runs the next step on the
cores left over.

    threads = ThreadFitter(max_threads=4)   # or Learner(..., threads="auto")
    threads.choose()                         # -> the thread count for the next step

The choice itself is `fit_threads`, a pure function of the readings (a test drives it with fake ones).
Rounding: a core counts as taken when others used more than `BUSY_FRACTION` of it; the count only grows
again after `GROW_AFTER` checks in a row asked for more, so a load that flickers does not make every other
step pay for a thread pool resize.

Bit-for-bit reproducibility needs the same thread count per step: some of torch's CPU reductions split their
work by thread, so their rounding can differ between thread counts (measured: none of a tiny-preset step's
bits at seq 64 x batch 4 moved between 1 and 2 threads; at seq 256 x batch 8 every LoRA tensor did, by up to
1.3e-6 after 4 steps). A learner's checkpoints record each step's count as runs (`add_step`), and a resumed
learner whose steps did not all run on one count says so in one line (`resume_note`): its weights are those
of any run that took each step on the same count, bit for bit. A run that must match any other run of the
same command keeps `threads=None` (torch's own setting) or a number.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

from edgetrain.registry import EdgetrainError
from edgetrain.utils.logs import get_logger

log = get_logger(__name__)

BUSY_FRACTION = 0.5  # a core others used more than half of since the last check is theirs
GROW_AFTER = 2       # checks in a row that must ask for more threads before the count grows
FIRST_SAMPLE_SECONDS = 0.1  # the first check's own interval (the kernel counts CPU time in 10 ms ticks)


@dataclass(frozen=True)
class CpuReading:
    """Cumulative counters at one moment: wall seconds, CPU seconds busy on all cores, CPU seconds of this
    process (user + system, all its threads)."""
    wall: float
    system_busy: float
    own: float


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def read_cpu() -> CpuReading:
    """The counters now (psutil: system-wide busy time is everything but idle and iowait)."""
    import psutil

    times = psutil.cpu_times()
    busy = sum(times) - times.idle - getattr(times, "iowait", 0.0)
    own = psutil.Process().cpu_times()
    return CpuReading(time.monotonic(), busy, own.user + own.system)


def others_busy_cores(before: CpuReading, after: CpuReading) -> float:
    """Cores' worth of CPU that other processes used between two readings (never below zero)."""
    wall = after.wall - before.wall
    if wall <= 0:
        return 0.0
    others = (after.system_busy - before.system_busy) - (after.own - before.own)
    return max(0.0, others / wall)


def fit_threads(cores: int, others_busy: float, max_threads: int | None = None) -> int:
    """Threads for the cores others left free: at least one, at most `max_threads` (default: `cores`)."""
    taken = int(others_busy + (1.0 - BUSY_FRACTION))  # 0.6 of a core others used rounds to a taken core
    free = max(1, cores - taken)
    return max(1, min(free, max_threads or cores))


@dataclass
class ThreadFitter:
    """Chooses each step's thread count from the cores others left free since the previous choice."""
    max_threads: int | None = None
    cores: int = field(default_factory=usable_cores)
    read: Callable[[], CpuReading] = read_cpu
    sleep: Callable[[float], None] = time.sleep
    current: int | None = None
    _last: CpuReading | None = None
    _wanting_more: int = 0

    def __post_init__(self) -> None:
        if self.max_threads is not None and (not isinstance(self.max_threads, int) or self.max_threads < 1):
            raise EdgetrainError(f"threads: max_threads must be a positive whole number, got {self.max_threads!r}")

    def choose(self) -> int:
        """The thread count for the next step, from the load since the previous call. The first call has no
        interval to judge by, so it samples one of FIRST_SAMPLE_SECONDS (the only pause): one first step on
        every core beside a busy app could take longer than many on the free ones."""
        if self._last is None:
            self._last = self.read()
            self.sleep(FIRST_SAMPLE_SECONDS)
        reading = self.read()
        wanted = fit_threads(self.cores, others_busy_cores(self._last, reading), self.max_threads)
        self._last = reading
        if self.current is None or wanted < self.current:
            self._wanting_more = 0
            self._settle(wanted)
        elif wanted > self.current:
            self._wanting_more += 1
            if self._wanting_more >= GROW_AFTER:
                self._wanting_more = 0
                self._settle(wanted)
        else:
            self._wanting_more = 0
        return self.current

    def _settle(self, threads: int) -> None:
        if self.current is not None and threads != self.current:
            log.info("intra-op threads %d -> %d (cores others left free)", self.current, threads)
        self.current = threads


def thread_fitter(threads: "int | str | ThreadFitter | None") -> ThreadFitter | int | None:
    """A learner's `threads` option: None (torch's own setting, untouched), a fixed count, "auto", or a
    ThreadFitter to share (the personaliser keeps one across its windows' learners)."""
    if threads is None or isinstance(threads, ThreadFitter):
        return threads
    if threads == "auto":
        return ThreadFitter()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise EdgetrainError(f"threads must be None, a positive whole number or 'auto', got {threads!r}")
    return threads


def thread_count(threads: "int | ThreadFitter") -> int:
    """The count a learner's `threads` (as thread_fitter returns it, not None) gives for the coming work."""
    return threads if isinstance(threads, int) else threads.choose()


def threads_flag(text: str) -> int | str:
    """argparse type of a --threads flag: "auto" or a positive whole number."""
    import argparse

    if text == "auto":
        return text
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number or 'auto', got {text!r}")
    return count


# A learner's thread counts as runs, oldest first: [count, steps] with count None where the learner left
# the threads to the framework (threads=None, or a backend that sizes its own pool).
ThreadRuns = list[list]


def add_step(runs: ThreadRuns, count: int | None) -> None:
    """Count one step taken on `count` threads into `runs` (in place): a run-length record, so a checkpoint
    of a long run stays a few numbers long."""
    if runs and runs[-1][0] == count:
        runs[-1][1] += 1
    else:
        runs.append([count, 1])


def describe_runs(runs: ThreadRuns) -> str:
    """'threads 2 x 25, then 1 x 15 steps', in the order the steps ran."""
    parts = [f"{_count_text(count)} x {steps}" for count, steps in runs]
    return "threads " + ", then ".join(parts) + " steps"


def _count_text(count: int | None) -> str:
    return "the framework's own" if count is None else str(count)


def resume_note(runs: ThreadRuns, threads: "int | ThreadFitter | None") -> str | None:
    """For a learner resumed with `runs` that goes on with `threads` (as thread_fitter returns it): one line
    saying what its bits promise when its steps did not all run on one count, or a fixed count (or the
    framework's own) goes on with another; None otherwise."""
    counts = {count for count, _ in runs}
    if isinstance(threads, int) or threads is None:
        counts.add(threads)  # the count every coming step takes
    if len(counts) <= 1:
        return None
    going_on = "auto" if isinstance(threads, ThreadFitter) else _count_text(threads)
    return (f"its steps ran on {describe_runs(runs)}, and this run goes on with threads {going_on}: the weights "
            "will be bit for bit those of a run that took each step on the same count, not necessarily those of a "
            "run on one count (the thread count changes the rounding of torch's larger CPU reductions)")
