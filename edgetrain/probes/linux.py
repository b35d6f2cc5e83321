"""Linux: what the kernel charges a process -- resident set size and its high-water mark.

Peak: `VmHWM` in /proc/<pid>/status, restarted by writing "5" to /proc/<pid>/clear_refs (Linux >= 4.0).
Current: `Rss` in /proc/<pid>/smaps_rollup (an exact page-table walk, Linux >= 4.14), else `VmRSS`.
File-backed: `RssFile` in /proc/<pid>/status (Linux >= 4.5), the part of RSS mapped from files.

glibc's mmap threshold makes a step's RSS peak depend on earlier steps: see edgetrain/probes/glibc.py.
"""
from __future__ import annotations

import gc
import mmap
import os
import sys
from pathlib import Path

from edgetrain.probes.base import PROBES, ProbeUnavailableError
from edgetrain.probes.glibc import release_free_heap

_SELF_CHECK_BYTES = 32 * 1024 * 1024
_self_check_result: tuple[bool, str] | None = None


def _self_check() -> tuple[bool, str]:
    """Does this kernel's /proc really track our resident memory, and does clear_refs reset it?

    Sandboxed kernels (gVisor, some CI runners) serve /proc files whose RSS and VmHWM never move;
    a probe reading them would report every step as free. Touch a private block, watch RSS rise,
    unmap it, reset, and watch the high-water mark fall back. Done once per process.
    """
    global _self_check_result
    if _self_check_result is not None:
        return _self_check_result
    for _attempt in range(3):  # a thread freeing memory meanwhile can hide the rise; look again
        _self_check_result = _self_check_once()
        if _self_check_result[0]:
            break
    return _self_check_result


def _self_check_once() -> tuple[bool, str]:
    gc.collect()
    release_free_heap()
    probe = LinuxProbe()
    try:
        before = probe.current_bytes()
        block = mmap.mmap(-1, _SELF_CHECK_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        page = b"\x01" * mmap.PAGESIZE
        for offset in range(0, _SELF_CHECK_BYTES, mmap.PAGESIZE):
            block[offset:offset + mmap.PAGESIZE] = page
        rise = probe.current_bytes() - before
        block.close()
        probe.reset_peak()
        left_in_peak = probe.peak_bytes() - probe.current_bytes()
    except (OSError, ProbeUnavailableError) as exc:
        return False, f"self-check could not read /proc/self: {exc}"
    mib = 1024 * 1024
    if rise < _SELF_CHECK_BYTES // 2:
        return (False, f"/proc/self does not track resident memory here: RSS moved {rise / mib:+.1f} MiB "
                       f"while a {_SELF_CHECK_BYTES // mib} MiB block was touched (a sandboxed kernel?)")
    if left_in_peak > _SELF_CHECK_BYTES // 2:
        return (False, "writing 5 to /proc/self/clear_refs does not reset VmHWM here "
                       f"(it stayed {left_in_peak / mib:.1f} MiB above RSS)")
    return True, ""


def _read_kb_field(path: Path, field: str) -> int | None:
    """Bytes of a `Field:   123 kB` line, or None when the file has no such line."""
    prefix = field + ":"
    with open(path) as f:
        for line in f:
            if line.startswith(prefix):
                return int(line.split()[1]) * 1024
    return None


@PROBES.register("linux")
class LinuxProbe:
    """Resident memory of one process (this one by default) as the Linux kernel counts it.

    The peak is the kernel's high-water mark, so it misses nothing between readings. It comes
    from the mm's RSS counters, which may lag the exact page count by a per-CPU batch (well under
    1 MiB on a few cores); peak_bytes() therefore never reports less than the exact current RSS.
    """

    name = "linux"

    def __init__(self, pid: int | None = None, *, proc_dir: str | Path | None = None) -> None:
        # proc_dir lets tests point the probe at a directory that lacks the kernel files.
        if proc_dir is not None:
            self.proc_dir = Path(proc_dir)
        else:
            self.proc_dir = Path("/proc") / ("self" if pid is None else str(pid))

    def prepare_process(self) -> None:
        """Pin glibc's mmap threshold: otherwise glibc keeps freed blocks of up to 32 MiB resident and
        reuses them, so every step after the first reports a peak near zero. Costs a page fault per large
        allocation; call it before the model and data are built."""
        from edgetrain.probes.glibc import fix_malloc_mmap_threshold

        fix_malloc_mmap_threshold()

    def available(self) -> tuple[bool, str]:
        if not sys.platform.startswith("linux"):
            return False, f"requires Linux /proc (this is {sys.platform})"
        status = self.proc_dir / "status"
        try:
            hwm = _read_kb_field(status, "VmHWM")
        except OSError as exc:
            return False, f"cannot read {status}: {exc.strerror or exc}"
        if hwm is None:
            return False, f"{status} has no VmHWM line (a kernel thread, or not a real /proc)"
        clear_refs = self.proc_dir / "clear_refs"
        if not clear_refs.exists():
            return False, f"{clear_refs} does not exist, so the high-water mark cannot be reset"
        if not os.access(clear_refs, os.W_OK):
            return False, f"{clear_refs} is not writable by this user, so the high-water mark cannot be reset"
        if self.proc_dir == Path("/proc/self"):
            return _self_check()
        return True, ""

    def reset_peak(self) -> None:
        clear_refs = self.proc_dir / "clear_refs"
        try:
            with open(clear_refs, "w") as f:
                f.write("5")  # 5 = reset the peak RSS (Documentation/filesystems/proc.rst)
        except OSError as exc:
            raise ProbeUnavailableError(f"cannot reset VmHWM through {clear_refs}: {exc}") from exc

    def peak_bytes(self) -> int:
        hwm = self._field("status", "VmHWM")
        return max(hwm, self.current_bytes())

    def current_bytes(self) -> int:
        try:
            rss = _read_kb_field(self.proc_dir / "smaps_rollup", "Rss")
        except OSError:  # before Linux 4.14, or not readable: the counter-based figure
            rss = None
        return rss if rss is not None else self._field("status", "VmRSS")

    def file_backed_bytes(self) -> int | None:
        """Resident pages mapped from files (`RssFile`, Linux >= 4.5): library code and memory-mapped
        weights, which a step maps in but does not allocate (edgetrain/training/step_memory.py subtracts their
        growth). None where the kernel does not say."""
        try:
            return _read_kb_field(self.proc_dir / "status", "RssFile")
        except OSError:
            return None

    def _field(self, file: str, field: str) -> int:
        path = self.proc_dir / file
        try:
            value = _read_kb_field(path, field)
        except OSError as exc:
            raise ProbeUnavailableError(f"cannot read {path}: {exc}") from exc
        if value is None:
            raise ProbeUnavailableError(f"{path} has no {field} line")
        return value
