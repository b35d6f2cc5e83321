"""Jetson probe: meminfo parsing, the not-a-Jetson and no-jtop paths, and sampled peaks over
hand-written Jetson files (the real ones exist only on the device)."""
from __future__ import annotations

import sys
import time
import types

import pytest

from edgetrain.probes import JetsonProbe, ProbeUnavailableError, is_jetson, parse_meminfo

# Trimmed from an AGX Orin running L4T R35 (kB values as the kernel prints them).
ORIN_MEMINFO = """\
MemTotal:       30536276 kB
MemFree:        21764152 kB
MemAvailable:   26312340 kB
Buffers:           83420 kB
Cached:          4425948 kB
SwapCached:            0 kB
HugePages_Total:       0
HugePages_Free:        0
Hugepagesize:       2048 kB
NvMapMemFree:      53248 kB
NvMapMemUsed:    1847296 kB
"""
KiB = 1024


def test_parse_meminfo_scales_kb_and_keeps_counts():
    info = parse_meminfo(ORIN_MEMINFO + "garbage line\nOddField:   notanumber kB\n")
    assert info["MemTotal"] == 30536276 * KiB
    assert info["MemAvailable"] == 26312340 * KiB
    assert info["NvMapMemUsed"] == 1847296 * KiB
    assert info["HugePages_Total"] == 0 and info["Hugepagesize"] == 2048 * KiB
    assert "OddField" not in info and "garbage line" not in info


def _fake_jetson(tmp_path, nvmap_kb: int = 1000, rss_kb: int = 500, with_nvmap: bool = True):
    (tmp_path / "nv_tegra_release").write_text("# R35 (release), REVISION: 4.1\n")
    _write(tmp_path, nvmap_kb, rss_kb, with_nvmap)
    return dict(meminfo_path=tmp_path / "meminfo", tegra_release_path=tmp_path / "nv_tegra_release",
                status_path=tmp_path / "status")


def _write(tmp_path, nvmap_kb: int, rss_kb: int, with_nvmap: bool = True) -> None:
    text = "MemTotal: 8000000 kB\nMemAvailable: 6000000 kB\n"
    if with_nvmap:
        text += f"NvMapMemUsed: {nvmap_kb} kB\n"
    # Written whole and renamed, so the sampling thread never reads a half-written file.
    for name, content in (("meminfo", text), ("status", f"Name:\tpython\nVmRSS:\t{rss_kb} kB\n")):
        tmp = tmp_path / (name + ".tmp")
        tmp.write_text(content)
        tmp.replace(tmp_path / name)


@pytest.mark.skipif(is_jetson(), reason="checks the not-a-Jetson path")
def test_unavailable_here_says_why():
    probe = JetsonProbe()
    ok, reason = probe.available()
    assert not ok and "not an NVIDIA Jetson" in reason
    with pytest.raises(ProbeUnavailableError, match="not an NVIDIA Jetson"):
        probe.current_bytes()


def test_missing_files_mean_not_a_jetson(tmp_path):
    probe = JetsonProbe(meminfo_path=tmp_path / "nope", tegra_release_path=tmp_path / "nope2")
    ok, reason = probe.available()
    assert not ok and "not an NVIDIA Jetson" in reason


def test_without_jetson_stats_falls_back_to_meminfo(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "jtop", None)  # makes `from jtop import jtop` raise ImportError
    probe = JetsonProbe(**_fake_jetson(tmp_path, nvmap_kb=1000, rss_kb=500))
    assert probe.available() == (True, "")
    assert probe.source.endswith("meminfo") and "not installed" in probe.source_note
    assert probe.current_bytes() == (1000 + 500) * KiB


def test_release_file_without_nvmap_and_without_jtop_is_unavailable(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "jtop", None)
    probe = JetsonProbe(**_fake_jetson(tmp_path, with_nvmap=False))
    ok, reason = probe.available()
    assert not ok and "NvMapMemUsed" in reason and "jetson-stats is not installed" in reason


def test_peak_is_the_max_of_samples_and_reset_restarts_it(tmp_path):
    probe = JetsonProbe(use_jtop=False, **_fake_jetson(tmp_path, nvmap_kb=1000, rss_kb=500))
    probe.reset_peak()
    _write(tmp_path, nvmap_kb=4000, rss_kb=700)
    assert probe.current_bytes() == 4700 * KiB
    _write(tmp_path, nvmap_kb=1000, rss_kb=600)
    assert probe.peak_bytes() == 4700 * KiB      # seen at the current_bytes() sample
    probe.reset_peak()
    assert probe.peak_bytes() == 1600 * KiB


def test_background_sampling_catches_a_spike_between_readings(tmp_path):
    probe = JetsonProbe(use_jtop=False, sample_interval_s=0.005, **_fake_jetson(tmp_path, 1000, 500))
    try:
        probe.reset_peak()
        _write(tmp_path, nvmap_kb=9000, rss_kb=500)
        time.sleep(0.2)  # forty sampling intervals
        _write(tmp_path, nvmap_kb=1000, rss_kb=500)
        assert probe.peak_bytes() == 9500 * KiB
    finally:
        probe.close()
    assert probe._sampler is None


def test_reads_nvmap_from_jtop_when_the_service_answers(tmp_path, monkeypatch):
    class FakeJtop:
        closed = False

        def start(self) -> None:
            pass

        @property
        def memory(self):
            return {"RAM": {"used": 3_000_000, "shared": 2500}}

        def close(self) -> None:
            FakeJtop.closed = True

    monkeypatch.setitem(sys.modules, "jtop", types.SimpleNamespace(jtop=FakeJtop))
    probe = JetsonProbe(**_fake_jetson(tmp_path, nvmap_kb=1000, rss_kb=500))
    assert probe.available() == (True, "") and probe.source == "jtop"
    assert probe.current_bytes() == (2500 + 500) * KiB   # jtop's figure, not meminfo's 1000
    probe.close()
    assert FakeJtop.closed


def test_a_jtop_service_that_refuses_is_a_reason_not_a_crash(tmp_path, monkeypatch):
    class RefusingJtop:
        def start(self) -> None:
            raise ConnectionRefusedError("/run/jtop.sock")

    monkeypatch.setitem(sys.modules, "jtop", types.SimpleNamespace(jtop=RefusingJtop))
    probe = JetsonProbe(**_fake_jetson(tmp_path, nvmap_kb=1000, rss_kb=500))
    assert probe.available() == (True, "")
    assert "ConnectionRefusedError" in probe.source_note
    assert probe.current_bytes() == 1500 * KiB
