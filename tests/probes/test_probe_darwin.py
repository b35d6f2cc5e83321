"""macOS probe: the rusage_info_v4 layout (against XNU's offsets) and the probe logic, driven
here through a fake libproc since proc_pid_rusage only exists on macOS."""
from __future__ import annotations

import ctypes
import struct
import sys

import pytest

from edgetrain.probes import DarwinProbe, ProbeUnavailableError, decode_rusage_info_v4, measure
from edgetrain.probes.darwin import RUSAGE_INFO_V4, RUSAGE_INFO_V4_FIELDS, RUSAGE_INFO_V4_SIZE

UUID = bytes(range(16))


def _rusage_buffer(**fields: int) -> bytes:
    """A rusage_info_v4 as the kernel lays it out: field i (0-based) at offset 16 + 8 * i."""
    buf = bytearray(296)
    buf[:16] = UUID
    for i in range(35):
        struct.pack_into("<Q", buf, 16 + 8 * i, 1000 + i)  # distinct filler in every field
    for offset, value in fields.items():
        struct.pack_into("<Q", buf, int(offset.removeprefix("at")), value)
    return bytes(buf)


def test_layout_matches_xnu():
    assert RUSAGE_INFO_V4_SIZE == 296 and len(RUSAGE_INFO_V4_FIELDS) == 35


def test_decode_reads_the_footprint_fields_at_their_xnu_offsets():
    info = decode_rusage_info_v4(_rusage_buffer(at72=123_456_789, at240=987_654_321, at280=555_000_111,
                                                at64=42, at288=7))
    assert info["ri_uuid"] == UUID
    assert info["ri_phys_footprint"] == 123_456_789
    assert info["ri_lifetime_max_phys_footprint"] == 987_654_321
    assert info["ri_interval_max_phys_footprint"] == 555_000_111
    assert info["ri_resident_size"] == 42
    assert info["ri_runnable_time"] == 7          # last field, offset 288
    assert info["ri_user_time"] == 1000           # first field, offset 16
    assert info["ri_instructions"] == 1000 + 29   # offset 248 = field 29


def test_decode_rejects_a_short_buffer():
    with pytest.raises(ValueError, match="296"):
        decode_rusage_info_v4(bytes(200))


@pytest.mark.skipif(sys.platform == "darwin", reason="checks the off-macOS path")
def test_unavailable_off_macos_says_why():
    probe = DarwinProbe()
    ok, reason = probe.available()
    assert not ok and "requires macOS" in reason
    with pytest.raises(ProbeUnavailableError, match="requires macOS"):
        probe.reset_peak()
    with pytest.raises(ProbeUnavailableError, match="requires macOS"):
        probe.current_bytes()


class FakeLibproc:
    """Stands in for libSystem: a process whose footprint the test moves around."""

    def __init__(self, resettable: bool = True) -> None:
        self.footprint = 100
        self.lifetime_max = 100
        self.interval_max = 100
        self.calls: list[tuple[int, int]] = []
        if resettable:
            self.proc_reset_footprint_interval = self._reset

    def set_footprint(self, value: int) -> None:
        self.footprint = value
        self.lifetime_max = max(self.lifetime_max, value)
        self.interval_max = max(self.interval_max, value)

    def proc_pid_rusage(self, pid: int, flavor: int, buf) -> int:
        self.calls.append((pid, flavor))
        data = _rusage_buffer(at72=self.footprint, at240=self.lifetime_max, at280=self.interval_max)
        ctypes.memmove(buf, data, len(data))
        return 0

    def _reset(self, pid: int) -> int:
        self.interval_max = self.footprint
        return 0


def test_probe_uses_the_resettable_interval_max():
    lib = FakeLibproc()
    probe = DarwinProbe(pid=4321, libproc=lib)
    assert probe.available() == (True, "") and probe.peak_is_resettable
    lib.set_footprint(5000)
    lib.set_footprint(300)
    probe.reset_peak()
    lib.set_footprint(900)
    lib.set_footprint(400)
    assert probe.current_bytes() == 400
    assert probe.peak_bytes() == 900            # not the lifetime 5000
    assert set(lib.calls) == {(4321, RUSAGE_INFO_V4)}


def test_measure_through_the_probe():
    lib = FakeLibproc()

    def region() -> None:
        lib.set_footprint(2100)
        lib.set_footprint(150)

    assert measure(DarwinProbe(libproc=lib), region) == 2000


def test_without_reset_the_lifetime_max_is_the_bound():
    lib = FakeLibproc(resettable=False)
    probe = DarwinProbe(libproc=lib)
    assert not probe.peak_is_resettable
    lib.set_footprint(5000)
    lib.set_footprint(300)
    probe.reset_peak()
    lib.set_footprint(900)
    assert probe.peak_bytes() == 5000           # an upper bound, documented as such


def test_failing_syscall_is_reported_not_raised():
    lib = FakeLibproc()
    lib.proc_pid_rusage = lambda pid, flavor, buf: -1
    ok, reason = DarwinProbe(libproc=lib).available()
    assert not ok and "proc_pid_rusage" in reason


@pytest.mark.skipif(sys.platform != "darwin", reason="needs macOS's proc_pid_rusage")
def test_real_footprint_on_macos():
    probe = DarwinProbe()
    assert probe.available() == (True, "")
    probe.reset_peak()
    block = b"\x01" * (64 * 1024 * 1024)
    assert probe.peak_bytes() - probe.current_bytes() < 8 * 1024 * 1024
    del block
    assert probe.peak_bytes() - probe.current_bytes() > 48 * 1024 * 1024
