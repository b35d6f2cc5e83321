"""The training policy: decisions from injected readings, the documented default for unknown ones, the real
readers on this machine (unknown or real values, never a crash), and a run that pauses and resumes as the
readings change."""
from __future__ import annotations

import time

import pytest

from edgetrain.personalise import FixedSensors, Policy, Readings, SystemSensors
from edgetrain.personalise.errors import PersonaliseError
from personalise_kit import Recorder, english_texts, make

GiB = 2**30


@pytest.mark.parametrize("policy, readings, idle, need, allowed, reason", [
    (Policy(), Readings(), None, None, True, ""),
    (Policy(require_power=True), Readings(on_power=False), None, None, False, "on battery"),
    (Policy(require_power=True), Readings(on_power=True), None, None, True, ""),
    (Policy(max_temp_c=70), Readings(temperature_c=71.5), None, None, False, "temperature 71.5 C"),
    (Policy(max_temp_c=70), Readings(temperature_c=69.0), None, None, True, ""),
    (Policy(min_free_bytes=GiB), Readings(available_bytes=2 * GiB), None, GiB + 1, False, "memory"),
    (Policy(min_free_bytes=GiB), Readings(available_bytes=3 * GiB), None, GiB, True, ""),
    (Policy(min_free_bytes=None), Readings(available_bytes=1), None, GiB, True, ""),
    (Policy(require_idle=True), Readings(), False, None, False, "not idle"),
    (Policy(require_idle=True), Readings(), True, None, True, ""),
    (Policy(require_power=True, max_temp_c=50), Readings(on_power=False, temperature_c=60), None, None, False,
     "on battery; temperature 60"),
])
def test_decisions_from_injected_readings(policy, readings, idle, need, allowed, reason):
    decision = policy.decide(readings, idle=idle, need_bytes=need)
    assert decision.allowed is allowed
    assert reason in decision.reason and (allowed or decision.reason)


def test_unknown_readings_allow_by_default_and_deny_when_asked():
    strict = dict(require_power=True, max_temp_c=60.0, min_free_bytes=0, require_idle=True)
    readings = Readings(notes={"on_power": "no battery reported"})
    relaxed = Policy(**strict).decide(readings)
    assert relaxed.allowed and set(relaxed.unknown) == {"on_power", "temperature_c", "available_bytes", "idle"}
    cautious = Policy(**strict, unknown="deny").decide(readings)
    assert not cautious.allowed and "on_power unknown (no battery reported)" in cautious.reason
    assert len(cautious.reasons) == 4
    with pytest.raises(PersonaliseError, match="allow"):
        Policy(unknown="maybe")


def test_the_real_readers_report_values_or_unknown_here_and_never_crash(monkeypatch):
    readings = SystemSensors().read()
    assert readings.on_power is None or isinstance(readings.on_power, bool)
    assert readings.temperature_c is None or -50 < readings.temperature_c < 150
    assert isinstance(readings.available_bytes, int) and readings.available_bytes > 0
    for name in ("on_power", "temperature_c"):  # unknown ones say why
        assert getattr(readings, name) is not None or readings.notes[name]
    assert "not an NVIDIA Jetson" in readings.notes.get("jetson", "not an NVIDIA Jetson")
    decision = Policy(require_power=True, max_temp_c=90.0).decide(readings)
    assert isinstance(decision.allowed, bool)

    import psutil

    def broken():
        raise OSError("sysfs went away")

    monkeypatch.setattr(psutil, "sensors_battery", broken)
    monkeypatch.setattr(psutil, "sensors_temperatures", broken)
    monkeypatch.setattr(psutil, "virtual_memory", broken)
    readings = SystemSensors().read()
    assert (readings.on_power, readings.temperature_c, readings.available_bytes) == (None, None, None)
    assert "sysfs went away" in readings.notes["on_power"]


def _store_with_examples(path, **options):
    recorder = Recorder()
    personaliser = make(path, on_event=recorder, **options)
    personaliser.add_many(english_texts(24))
    return personaliser, recorder


def test_a_run_on_battery_pauses_with_the_reason_and_trains_on_power(tmp_path):
    sensors = FixedSensors(on_power=False)
    personaliser, recorder = _store_with_examples(tmp_path, sensors=sensors, policy=Policy(require_power=True,
                                                                                           check_every_s=0))
    result = personaliser.run(max_steps=3)
    assert result.reason == "policy" and result.steps == 0
    assert recorder.of("paused")[-1]["reason"] == "on battery"
    status = personaliser.status()
    assert status["last_pause"]["reason"] == "on battery" and status["policy"]["allowed"] is False
    sensors.set(on_power=True)
    assert personaliser.run(max_steps=3).steps == 3
    assert personaliser.status()["policy"]["allowed"] is True


def test_a_background_run_waits_while_hot_and_goes_on_when_cool(tmp_path):
    sensors = FixedSensors(temperature_c=85.0)
    personaliser, recorder = _store_with_examples(tmp_path, sensors=sensors,
                                                  policy=Policy(max_temp_c=80, check_every_s=0))
    personaliser.start()
    deadline = time.monotonic() + 20
    while not recorder.of("paused") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "temperature 85.0 C at or above the limit 80 C" in recorder.of("paused")[0]["reason"]
    assert recorder.of("step") == []
    sensors.set(temperature_c=60.0)
    while len(recorder.of("step")) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    personaliser.stop()
    assert recorder.of("resumed")[0]["after"].startswith("temperature") and len(recorder.of("step")) >= 2


def test_too_little_free_memory_for_the_step_pauses_before_the_first_step(tmp_path):
    sensors = FixedSensors(available_bytes=1000)
    personaliser, recorder = _store_with_examples(tmp_path, sensors=sensors)
    result = personaliser.run(max_steps=2)
    assert result.reason == "policy" and recorder.of("step") == []
    assert "memory" in recorder.of("paused")[-1]["reason"] and "the step needs" in recorder.of("paused")[-1]["reason"]
    sensors.set(available_bytes=64 * GiB)
    assert personaliser.run(max_steps=2).steps == 2


def test_the_apps_idle_flag(tmp_path):
    personaliser, recorder = _store_with_examples(tmp_path, policy=Policy(require_idle=True, check_every_s=0),
                                                  sensors=FixedSensors())
    assert personaliser.run(max_steps=1).steps == 1  # never declared: unknown, allowed by default
    personaliser.set_idle(False)
    assert personaliser.run(max_steps=1).reason == "policy"
    assert recorder.of("paused")[-1]["reason"] == "the app is not idle"
    personaliser.set_idle(True)
    assert personaliser.run(max_steps=1).steps == 1
