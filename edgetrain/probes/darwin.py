"""macOS: the physical footprint the kernel bills the process for (what Activity Monitor's
"Memory" column and jetsam limits use; compressed pages included, unlike RSS).

Read with `proc_pid_rusage(pid, RUSAGE_INFO_V4, &buf)` from libproc (part of libSystem):
  ri_phys_footprint               -- now
  ri_interval_max_phys_footprint  -- peak since the last `proc_reset_footprint_interval(pid)`
  ri_lifetime_max_phys_footprint  -- peak since the process started
`proc_reset_footprint_interval` (libproc_internal.h, macOS 10.14+) is what WebKit's
ProcessMemoryFootprint::resetPeak() calls; in XNU it is
`proc_rlimit_control(pid, RLIMIT_FOOTPRINT_INTERVAL, FOOTPRINT_INTERVAL_RESET)`. Until it is first
called the interval max equals the lifetime max. Where the symbol is missing the probe falls back
to the lifetime max, an upper bound on the region's peak (`peak_is_resettable` says which).
"""
from __future__ import annotations

import ctypes
import os
import struct
import sys
from typing import Any

from edgetrain.probes.base import PROBES, ProbeUnavailableError, require_available

RUSAGE_INFO_V4 = 4

# struct rusage_info_v4 (XNU bsd/sys/resource.h): a 16-byte uuid, then 35 uint64 fields, in order.
RUSAGE_INFO_V4_FIELDS = (
    "ri_user_time", "ri_system_time", "ri_pkg_idle_wkups", "ri_interrupt_wkups", "ri_pageins",
    "ri_wired_size", "ri_resident_size", "ri_phys_footprint", "ri_proc_start_abstime",
    "ri_proc_exit_abstime", "ri_child_user_time", "ri_child_system_time",
    "ri_child_pkg_idle_wkups", "ri_child_interrupt_wkups", "ri_child_pageins",
    "ri_child_elapsed_abstime", "ri_diskio_bytesread", "ri_diskio_byteswritten",
    "ri_cpu_time_qos_default", "ri_cpu_time_qos_maintenance", "ri_cpu_time_qos_background",
    "ri_cpu_time_qos_utility", "ri_cpu_time_qos_legacy", "ri_cpu_time_qos_user_initiated",
    "ri_cpu_time_qos_user_interactive", "ri_billed_system_time", "ri_serviced_system_time",
    "ri_logical_writes", "ri_lifetime_max_phys_footprint", "ri_instructions", "ri_cycles",
    "ri_billed_energy", "ri_serviced_energy", "ri_interval_max_phys_footprint", "ri_runnable_time",
)
# "=": native byte order (both Apple architectures are little-endian) with standard sizes, no padding.
_RUSAGE_INFO_V4 = struct.Struct("=16s" + "Q" * len(RUSAGE_INFO_V4_FIELDS))
RUSAGE_INFO_V4_SIZE = _RUSAGE_INFO_V4.size  # 296


def decode_rusage_info_v4(buf: bytes) -> dict[str, Any]:
    """Field name -> value of a `struct rusage_info_v4` (ri_uuid as 16 bytes, the rest ints)."""
    if len(buf) < RUSAGE_INFO_V4_SIZE:
        raise ValueError(f"rusage_info_v4 is {RUSAGE_INFO_V4_SIZE} bytes; got {len(buf)}")
    uuid, *values = _RUSAGE_INFO_V4.unpack_from(buf)
    return {"ri_uuid": uuid, **dict(zip(RUSAGE_INFO_V4_FIELDS, values))}


def _load_libproc() -> Any:
    # libproc's symbols are exported by libSystem; on macOS 11+ the dylib lives in the shared
    # cache, where dlopen by path still works although the file is absent from disk.
    lib = ctypes.CDLL("/usr/lib/libSystem.B.dylib", use_errno=True)
    lib.proc_pid_rusage.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.proc_pid_rusage.restype = ctypes.c_int
    try:
        lib.proc_reset_footprint_interval.argtypes = [ctypes.c_int]
        lib.proc_reset_footprint_interval.restype = ctypes.c_int
    except AttributeError:  # before macOS 10.14
        pass
    return lib


@PROBES.register("darwin")
class DarwinProbe:
    """Physical footprint of one process (this one by default) on macOS."""

    name = "darwin"

    def __init__(self, pid: int | None = None, *, libproc: Any = None) -> None:
        """`libproc`: an object with proc_pid_rusage(pid, flavor, buf) [and
        proc_reset_footprint_interval(pid)] -- tests pass a fake to drive both paths anywhere."""
        self.pid = os.getpid() if pid is None else pid
        self._libproc = libproc
        self._load_error = ""
        if libproc is None and sys.platform == "darwin":
            try:
                self._libproc = _load_libproc()
            except (OSError, AttributeError) as exc:
                self._load_error = f"cannot load proc_pid_rusage from libSystem: {exc}"

    @property
    def peak_is_resettable(self) -> bool:
        return self._libproc is not None and hasattr(self._libproc, "proc_reset_footprint_interval")

    def available(self) -> tuple[bool, str]:
        if self._libproc is None:
            if sys.platform != "darwin":
                return False, f"phys_footprint requires macOS (this is {sys.platform})"
            return False, self._load_error
        try:
            self.rusage()
        except ProbeUnavailableError as exc:
            return False, str(exc)
        return True, ""

    def rusage(self) -> dict[str, Any]:
        """The whole rusage_info_v4 of the process, decoded."""
        if self._libproc is None:
            raise ProbeUnavailableError(self.available()[1])
        buf = ctypes.create_string_buffer(RUSAGE_INFO_V4_SIZE)
        rc = self._libproc.proc_pid_rusage(self.pid, RUSAGE_INFO_V4, buf)
        if rc != 0:
            err = ctypes.get_errno()
            raise ProbeUnavailableError(
                f"proc_pid_rusage({self.pid}, RUSAGE_INFO_V4) failed: {os.strerror(err) if err else rc}")
        return decode_rusage_info_v4(buf.raw)

    def reset_peak(self) -> None:
        if not self.peak_is_resettable:
            require_available(self)  # nothing to reset, but an unusable probe must still say so
            return
        if self._libproc.proc_reset_footprint_interval(self.pid) != 0:
            err = ctypes.get_errno()
            raise ProbeUnavailableError(
                f"proc_reset_footprint_interval({self.pid}) failed: {os.strerror(err) if err else 'error'}")

    def peak_bytes(self) -> int:
        info = self.rusage()
        if self.peak_is_resettable:
            peak = info["ri_interval_max_phys_footprint"]
        else:
            # Without a resettable counter the lifetime max is the best bound we have; it equals
            # the region's peak whenever the region set a new lifetime record.
            peak = info["ri_lifetime_max_phys_footprint"]
        return max(peak, info["ri_phys_footprint"])

    def current_bytes(self) -> int:
        return self.rusage()["ri_phys_footprint"]
