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
from contextlib import contextmanager
from typing import Any, Iterator

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


def main_heap_range(maps_path: str = "/proc/self/maps") -> tuple[int, int] | None:
    """[start, end) of the main arena's heap (the `[heap]` mapping), or None where there is none to read."""
    try:
        with open(maps_path) as f:
            for line in f:
                if line.rstrip().endswith("[heap]"):
                    start, end = line.split()[0].split("-")
                    return int(start, 16), int(end, 16)
    except OSError:
        return None
    return None


@contextmanager
def plugged_free_heap(min_bytes: int = STABLE_MMAP_THRESHOLD_BYTES) -> Iterator[int]:
    """Occupy the main arena's free chunks of `min_bytes` or more for the duration, without touching them;
    yields how many bytes were plugged.

    Why: glibc serves a large request from a free arena chunk that fits before it maps fresh memory, and a
    chunk freed inside the arena stays resident. A process whose arena holds large free chunks (memory
    allocated and freed before the mmap threshold was pinned: a model loaded, an autograd step) runs a
    measured region in them; blocks freed and allocated again during the region land at new places in
    those chunks, so RSS climbs past the region's live peak. With the chunks plugged, the region's large
    blocks are mapped and unmapped as in a fresh process. Plugs cost address space, not memory: malloc hands
    out a chunk without touching it (after release_free_heap its pages are not resident).

    Sizes are tried from the arena's free total down by halves, never plugging more than that total; a block
    that malloc mapped fresh (its chunk header's IS_MMAPPED bit) ends that size. The arena is found by that bit, not by address: when brk cannot
    grow the `[heap]` mapping, glibc extends the main arena with mappings elsewhere (a free chunk outside
    `[heap]`, which a plug by address would miss). Only the main arena (the main
    thread's, which runs the step) is plugged. No-op off glibc."""
    libc = _libc()
    plugs: list[int] = []
    plugged = 0
    try:
        free_bytes = _arena_free_bytes(libc) if libc is not None else 0
        size = 1 << max(0, free_bytes.bit_length() - 1)
        while libc is not None and size >= min_bytes:
            # Never more than was free: with the threshold not pinned, malloc serves a request below it by
            # growing the arena, and those blocks would pass the mapped-chunk test forever.
            while plugged + size <= free_bytes:
                address = libc.malloc(size)
                if not address:
                    break
                if _is_mapped_chunk(address):
                    libc.free(address)
                    break
                plugs.append(address)
                plugged += size
            size //= 2
        yield plugged
    finally:
        for address in plugs:
            libc.free(address)


# glibc's chunk header: the size word just before the block, its low bits flags; IS_MMAPPED marks a block
# mapped on its own (not carved from an arena).
_IS_MMAPPED = 0x2


def _is_mapped_chunk(address: int) -> bool:
    return bool(ctypes.c_size_t.from_address(address - ctypes.sizeof(ctypes.c_size_t)).value & _IS_MMAPPED)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _arena_free_bytes(libc: Any) -> int:
    """Free bytes held by the arenas (mallinfo2's fordblks, glibc 2.33+; else the [heap] mapping's size)."""
    mallinfo2 = getattr(libc, "mallinfo2", None)
    if mallinfo2 is not None:
        mallinfo2.restype = _MallInfo2
        return int(mallinfo2().fordblks)
    heap = main_heap_range()
    return 0 if heap is None else heap[1] - heap[0]


def _libc() -> Any:
    """The C library's malloc and free, typed, or None off glibc."""
    if glibc_version() is None:
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
        libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
    except (OSError, AttributeError):
        return None
    return libc


def malloc_threshold_env(threshold_bytes: int = STABLE_MMAP_THRESHOLD_BYTES) -> dict[str, str]:
    """Environment entries that pin the threshold in a child process from its first allocation
    (merge into the child's env: `{**os.environ, **malloc_threshold_env()}`)."""
    if not 0 < threshold_bytes <= _MAX_MMAP_THRESHOLD_BYTES:
        raise ValueError(f"threshold {threshold_bytes} is outside glibc's range 1..{_MAX_MMAP_THRESHOLD_BYTES}")
    return {"MALLOC_MMAP_THRESHOLD_": str(threshold_bytes)}
