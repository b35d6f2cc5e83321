"""What one training step adds to the memory the process holds: the figure `StepStats.peak_bytes`
reports and the memory-budget guard charges a step.

    with StepMemory(probe) as window:
        method.step(batch, optimizer)
    window.added_bytes   # peak during the step - usage just before it - file pages it mapped in

It is read by the learner's probe, with corrections for each way the same step used to read differently
depending on what the process had done before (the figures are in docs/concepts.md, "Memory probes"):

- Free heap memory. A process holds free heap chunks that are still resident, and glibc serves even
  large requests from a free chunk that fits before it maps fresh memory: a step served from them adds
  nothing to RSS. So before the step the free memory is given back to the kernel (malloc_trim), and the
  heap's free chunks of 64 KiB or more are plugged for the step's duration
  (edgetrain.probes.glibc.plugged_free_heap: untouched, they cost address space, not memory). Trimming
  alone is not enough: blocks freed and allocated again during the step land at new places in the
  chunks and stay resident. The young garbage generations are collected too (cheap); a full collection
  is left to the first step, which the budget guard settles fully.
- File-backed pages the step maps in are not step memory: the weights of a checkpoint loaded
  memory-mapped (safetensors), read for the first time by the first forward, and the library code of
  kernels run for the first time. They are counted where they belong -- the weights once, at their full
  size, by the budget guard; code not at all -- and clean file pages are the kernel's to drop and read
  again. A probe that can tell them apart (`file_backed_bytes()`, the Linux probe's RssFile) has their
  growth during the step subtracted. The growth is read when the step ends, so pages mapped in after the
  step's peak are subtracted too; the figure is then a lower bound, short by those pages (a forward maps
  the weights in before the backward peaks).
- A probe that only sees memory while it is active (tensor accounting, a dispatch mode) is entered
  before the baseline is read: otherwise its first window counted the model it registers on entry as
  memory the step allocated.

What remains is the step's own: the peak of its live tensors, the allocator's slack around them, kernel
workspaces, and on the first step of a process its one-time allocations (thread pools, kernel caches),
which later steps no longer pay.
"""
from __future__ import annotations

import gc
from contextlib import ExitStack
from typing import Any

from edgetrain.probes.base import MemoryProbe, observing_context
from edgetrain.probes.glibc import plugged_free_heap, release_free_heap


def release_before_step() -> None:
    """Collect young garbage and give the allocator's free memory back to the kernel, so that what the
    coming step allocates shows up as new resident memory (see the module docstring)."""
    gc.collect(1)
    release_free_heap()


def file_backed_bytes(probe: MemoryProbe) -> int | None:
    """The probe's file-backed resident memory now, or None when the probe cannot tell it apart."""
    reader = getattr(probe, "file_backed_bytes", None)
    return reader() if callable(reader) else None


class StepMemory:
    """The memory one step adds, read by `probe` (see the module docstring); `added_bytes` is set
    when the `with` block ends without an exception."""

    def __init__(self, probe: MemoryProbe) -> None:
        self.probe = probe
        self.added_bytes: int | None = None
        self._stack = ExitStack()
        self._baseline = 0
        self._file_before: int | None = None

    def __enter__(self) -> "StepMemory":
        self._stack.enter_context(observing_context(self.probe))
        try:
            release_before_step()
            self._stack.enter_context(plugged_free_heap())
            self.probe.reset_peak()
            self._baseline = self.probe.current_bytes()
            self._file_before = file_backed_bytes(self.probe)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        try:
            if exc_type is None:
                self.added_bytes = self._read_added()
        finally:
            self._stack.close()

    def _read_added(self) -> int:
        added = self.probe.peak_bytes() - self._baseline
        file_after = file_backed_bytes(self.probe)
        if self._file_before is not None and file_after is not None:
            added -= max(0, file_after - self._file_before)
        # A probe whose counter is approximate (per-CPU RSS counters) can read a hair under the baseline.
        return max(0, added)
