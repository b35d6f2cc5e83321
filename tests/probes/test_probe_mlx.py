"""MLX probe: real readings with mlx[cpu]; the old mx.metal names; the no-mlx path."""
from __future__ import annotations

import sys
import types

import pytest

from edgetrain.probes import MlxProbe, ProbeUnavailableError, measure

MiB = 1024 * 1024


def test_peak_grows_with_an_array_and_reset_lowers_it():
    mx = pytest.importorskip("mlx.core")
    probe = MlxProbe()
    assert probe.available() == (True, "")
    probe.reset_peak()
    start = probe.peak_bytes()
    big = mx.ones((2048, 2048)) * 3.0    # 16 MiB of float32 (plus the 16 MiB `ones` it came from)
    mx.eval(big)
    assert probe.current_bytes() >= 16 * MiB
    assert probe.peak_bytes() - start >= 16 * MiB
    del big
    assert probe.peak_bytes() - probe.current_bytes() >= 16 * MiB   # freed, but the peak remembers
    probe.reset_peak()
    assert probe.peak_bytes() == probe.current_bytes()


def test_reset_keeps_what_is_live_in_the_peak():
    mx = pytest.importorskip("mlx.core")
    probe = MlxProbe()
    held = mx.ones((1024, 1024))
    mx.eval(held)
    probe.reset_peak()    # MLX zeroes its peak here; the probe must not report less than live memory
    assert probe.peak_bytes() >= 4 * MiB
    del held


def test_measure_counts_a_temporary():
    mx = pytest.importorskip("mlx.core")

    def region() -> None:
        tmp = mx.zeros((1024, 1024)) + 1.0
        mx.eval(tmp)

    assert measure(MlxProbe(), region) >= 4 * MiB


def test_older_mlx_names_under_metal(monkeypatch):
    calls = []
    metal = types.SimpleNamespace(get_peak_memory=lambda: 300, get_active_memory=lambda: 120,
                                  reset_peak_memory=lambda: calls.append("reset"))
    core = types.ModuleType("mlx.core")
    core.metal = metal
    pkg = types.ModuleType("mlx")
    pkg.core = core
    monkeypatch.setitem(sys.modules, "mlx", pkg)
    monkeypatch.setitem(sys.modules, "mlx.core", core)
    probe = MlxProbe()
    assert probe.available() == (True, "")
    probe.reset_peak()
    assert calls == ["reset"]
    assert probe.peak_bytes() == 300 and probe.current_bytes() == 120


def test_unavailable_without_mlx_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlx.core", None)  # `import mlx.core` raises ImportError
    probe = MlxProbe()
    ok, reason = probe.available()
    assert not ok and "mlx is not importable" in reason
    with pytest.raises(ProbeUnavailableError, match="mlx is not importable"):
        probe.peak_bytes()
