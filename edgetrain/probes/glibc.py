"""glibc's allocator, tuned so that RSS measures what a region allocates.

With the default *dynamic* mmap threshold, freeing a large mmap'd block raises the
threshold to that block's size (up to 32 MiB), so later blocks of that size come from the heap and
stay resident after free. A step's peak above its baseline then depends on what the previous steps
left cached, and jumps between ~0 and the real figure. `fix_malloc_mmap_threshold()` (this process;
call it before torch allocates much) or `malloc_threshold_env()` (a child process) pin the threshold,
after which every block of 64 KiB or more is returned to the kernel on free and identical steps
report identical peaks.
"""
from __future__ import annotations

import ctypes
import os

# glibc <malloc.h>: mallopt parameter number of M_MMAP_THRESHOLD.
M_MMAP_THRESHOLD = -3
# Big enough that small-object churn stays on the heap, small enough that every tensor worth
# counting is its own mapping.
STABLE_MMAP_THRESHOLD_BYTES = 65536
# glibc refuses thresholds above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit).
_MAX_MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024


def glibc_version() -> str | None:
    """The glibc version ("2.36"), or None under another C library (musl, macOS)."""
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION")  # "glibc 2.36"
    except (ValueError, OSError, AttributeError):
        return None
    if not libc or not libc.startswith("glibc"):
        return None
    return libc.split()[-1]


def fix_malloc_mmap_threshold(threshold_bytes: int = STABLE_MMAP_THRESHOLD_BYTES) -> tuple[bool, str]:
    """Pin glibc's mmap threshold in this process (mallopt(M_MMAP_THRESHOLD, n)); (ok, why not).

    Pinning also turns off glibc's dynamic threshold adjustment, which is the point. It affects
    allocations made after the call, so make it before the model and data are built.
    """
    if not 0 < threshold_bytes <= _MAX_MMAP_THRESHOLD_BYTES:
        return False, f"threshold {threshold_bytes} is outside glibc's range 1..{_MAX_MMAP_THRESHOLD_BYTES}"
    if glibc_version() is None:
        return False, "mallopt(M_MMAP_THRESHOLD) needs glibc; this C library is not glibc"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError) as exc:
        return False, f"cannot find mallopt in the C library: {exc}"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, threshold_bytes) != 1:
        return False, f"mallopt(M_MMAP_THRESHOLD, {threshold_bytes}) was refused"
    return True, ""


def release_free_heap() -> bool:
    """Give the free memory of every malloc arena back to the kernel (glibc's malloc_trim(0)).

    A long-running process accumulates free chunks in the middle of its heap that stay resident;
    a later allocation served from them adds nothing to RSS, so a peak measured from RSS would miss
    it. Trimming first makes every byte a measured region uses show up. False off glibc.
    """
    if glibc_version() is None:
        return False
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim.restype = ctypes.c_int
    malloc_trim(0)
    return True


def malloc_threshold_env(threshold_bytes: int = STABLE_MMAP_THRESHOLD_BYTES) -> dict[str, str]:
    """Environment entries that pin the threshold in a child process from its first allocation
    (merge into the child's env: `{**os.environ, **malloc_threshold_env()}`)."""
    if not 0 < threshold_bytes <= _MAX_MMAP_THRESHOLD_BYTES:
        raise ValueError(f"threshold {threshold_bytes} is outside glibc's range 1..{_MAX_MMAP_THRESHOLD_BYTES}")
    return {"MALLOC_MMAP_THRESHOLD_": str(threshold_bytes)}
