"""The probe contract, the registry that finds probes by name, and the helper that measures a region.

A probe reads what something outside Python charges for memory: the kernel (RSS, phys_footprint),
an allocator (CUDA caching allocator, MLX), or our own tensor bookkeeping. Every probe answers the
same five questions; `available()` never raises, and says why when the answer is no.
"""
from __future__ import annotations

import gc
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, runtime_checkable

from edgetrain.backends.host import is_jetson  # noqa: F401  (edgetrain.probes.is_jetson)
from edgetrain.probes.glibc import release_free_heap
from edgetrain.registry import EdgetrainError, Registry


class ProbeUnavailableError(EdgetrainError):
    """A reading was asked of a probe that cannot work here; the message says why."""


@runtime_checkable
class MemoryProbe(Protocol):
    name: str

    def available(self) -> tuple[bool, str]:
        """(True, "") or (False, why) -- never raises."""

    def reset_peak(self) -> None:
        """Start a new peak window at the current usage."""

    def peak_bytes(self) -> int:
        """Highest usage since the last reset_peak() (absolute, baseline included)."""

    def current_bytes(self) -> int:
        """Usage now."""


# name -> constructor; every constructor works with no arguments (options are keyword-only).
PROBES: Registry[Callable[..., MemoryProbe]] = Registry("probe")


def require_available(probe: MemoryProbe) -> None:
    ok, reason = probe.available()
    if not ok:
        raise ProbeUnavailableError(f"memory probe {probe.name!r} is not available here: {reason}")


def default_probe_name(backend: str) -> str:
    """Which probe reads the memory a backend really uses (its registry entry says)."""
    from edgetrain.backends import BACKENDS

    if backend not in BACKENDS:
        raise EdgetrainError(f"no default memory probe for backend {backend!r}; "
                             f"known backends: {', '.join(BACKENDS.names())}")
    return BACKENDS.get(backend).probe()


def default_probe(backend: str) -> MemoryProbe:
    """A fresh probe for `backend` (see default_probe_name); check .available() before reading it."""
    return PROBES.get(default_probe_name(backend))()


@dataclass
class Measurement:
    """Filled in when a `measuring` block ends."""
    probe: str
    baseline_bytes: int
    peak_bytes: int = 0

    @property
    def peak_above_baseline_bytes(self) -> int:
        # A probe whose counter is approximate (per-CPU RSS counters) can read a hair under the
        # baseline for a region that allocated nothing; that is zero, not a negative allocation.
        return max(0, self.peak_bytes - self.baseline_bytes)


def settle_memory() -> None:
    """Before a measured window: collect garbage (otherwise a collection that happens to run inside
    the window frees earlier objects and hides the region's own peak) and give free heap back to the
    kernel (otherwise the region reuses resident free chunks and RSS does not see it)."""
    gc.collect()
    release_free_heap()


def observing_context(probe: MemoryProbe) -> AbstractContextManager[Any]:
    # Probes that see memory only while active (the tensor accountant is a dispatch mode) are
    # entered around the region; the OS and allocator probes see everything and are not.
    if hasattr(probe, "__enter__") and hasattr(probe, "__exit__"):
        return probe  # type: ignore[return-value]
    return nullcontext()


@contextmanager
def measuring(probe: MemoryProbe) -> Iterator[Measurement]:
    """Reset the probe's peak, run the block, and record its peak and the baseline it started from."""
    require_available(probe)
    settle_memory()
    with observing_context(probe):
        probe.reset_peak()
        result = Measurement(probe=probe.name, baseline_bytes=probe.current_bytes())
        yield result
        result.peak_bytes = probe.peak_bytes()


def measure(probe: MemoryProbe, fn: Callable[[], Any]) -> int:
    """Peak bytes above the pre-call baseline while `fn()` runs."""
    with measuring(probe) as result:
        fn()
    return result.peak_above_baseline_bytes
