"""Probe registry, default choice per backend, and the measure helpers."""
from __future__ import annotations

import pytest

from edgetrain.probes import (PROBES, MemoryProbe, ProbeUnavailableError, default_probe, default_probe_name,
                              measure, measuring)
from edgetrain.backends import host
from edgetrain.registry import EdgetrainError, UnknownNameError


def test_every_probe_is_registered_and_answers_available_without_raising():
    assert PROBES.names() == ["cuda", "darwin", "jetson", "linux", "mlx", "tensors"]
    for name in PROBES.names():
        probe = PROBES.get(name)()
        assert isinstance(probe, MemoryProbe) and probe.name == name
        ok, reason = probe.available()
        assert isinstance(ok, bool) and isinstance(reason, str)
        assert ok or reason, f"{name} is unavailable without saying why"
    with pytest.raises(UnknownNameError, match="known probes: cuda, darwin"):
        PROBES.get("nvml")


@pytest.mark.parametrize("platform, jetson, expected", [
    ("linux", False, "linux"), ("linux", True, "jetson"), ("darwin", False, "darwin")])
def test_default_probe_for_torch_cpu_follows_the_machine(monkeypatch, platform, jetson, expected):
    monkeypatch.setattr(host.sys, "platform", platform)
    monkeypatch.setattr(host, "is_jetson", lambda: jetson)
    assert default_probe_name("torch-cpu") == expected
    assert default_probe("torch-cpu").name == expected


def test_default_probe_for_accelerators_and_unknown_backends():
    assert default_probe("torch-cuda").name == "cuda"
    assert default_probe("mlx").name == "mlx"
    with pytest.raises(EdgetrainError, match="no default memory probe for backend 'tpu'"):
        default_probe_name("tpu")


class ScriptedProbe:
    """A probe whose readings the test controls."""

    name = "scripted"

    def __init__(self) -> None:
        self.current = 1000
        self.peak = 5000  # stale peak from before the region

    def available(self) -> tuple[bool, str]:
        return True, ""

    def reset_peak(self) -> None:
        self.peak = self.current

    def peak_bytes(self) -> int:
        return self.peak

    def current_bytes(self) -> int:
        return self.current

    def allocate(self, n: int) -> None:
        self.current += n
        self.peak = max(self.peak, self.current)


def test_measure_resets_first_and_subtracts_the_baseline():
    probe = ScriptedProbe()

    def region() -> None:
        probe.allocate(700)
        probe.allocate(-700)
        probe.allocate(200)

    assert measure(probe, region) == 700
    with measuring(probe) as m:
        probe.allocate(50)
    assert (m.baseline_bytes, m.peak_bytes, m.peak_above_baseline_bytes) == (1200, 1250, 50)


def test_measure_refuses_an_unavailable_probe_with_its_reason():
    probe = ScriptedProbe()
    probe.available = lambda: (False, "no such counter on this board")
    ran = []
    with pytest.raises(ProbeUnavailableError, match="no such counter on this board"):
        measure(probe, lambda: ran.append(1))
    assert not ran
