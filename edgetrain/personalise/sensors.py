"""What the device reports about itself, for the training policy: power, temperature, free memory.

Each reading is a value or None ("unknown"), and an unknown one carries a note saying why (no battery, no
temperature sensors, not a Jetson). The real readers never raise: a sensor that fails is an unknown
reading, so a policy check cannot crash the app.

- power (on external power?): psutil's battery (Linux, macOS, Windows): `power_plugged`; None when the
  machine reports no battery. On an NVIDIA Jetson with jetson-stats' service running: True (Jetson boards
  run from an external supply; jtop's total power draw goes in the note).
- temperature: the hottest of psutil's sensors (Linux; psutil has none on macOS), or of jtop's on a Jetson.
- available memory: psutil's `virtual_memory().available` (on a Jetson the same RAM serves the GPU).

Tests and apps with their own knowledge inject readings instead: `FixedSensors(on_power=False, ...)`, or any
object with a `read() -> Readings` method, passed as `Personaliser(sensors=...)`.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Any, Protocol


@dataclass(frozen=True)
class Readings:
    """One look at the device. None = unknown; `notes` says why a reading is unknown (or where it came from)."""

    on_power: bool | None = None
    temperature_c: float | None = None
    available_bytes: int | None = None
    notes: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"on_power": self.on_power, "temperature_c": self.temperature_c,
                "available_bytes": self.available_bytes, "notes": dict(self.notes)}


class Sensors(Protocol):
    def read(self) -> Readings: ...


class FixedSensors:
    """Readings set by hand (tests, an app that knows better): `set(...)` changes them while a run uses them."""

    def __init__(self, on_power: bool | None = None, temperature_c: float | None = None,
                 available_bytes: int | None = None) -> None:
        self._readings = Readings(on_power, temperature_c, available_bytes, {"source": "injected"})
        self._lock = threading.Lock()
        self.reads = 0

    def set(self, **readings: Any) -> None:
        with self._lock:
            self._readings = replace(self._readings, **readings)

    def read(self) -> Readings:
        with self._lock:
            self.reads += 1
            return self._readings


def _battery() -> tuple[bool | None, str]:
    import psutil

    reader = getattr(psutil, "sensors_battery", None)
    if reader is None:
        return None, "psutil has no battery reader on this platform"
    try:
        battery = reader()
    except Exception as exc:  # noqa: BLE001 -- a sensor must never crash the app
        return None, f"reading the battery failed ({type(exc).__name__}: {exc})"
    if battery is None:
        return None, "no battery reported (psutil.sensors_battery() is None): a machine without one is usually on mains power"
    if battery.power_plugged is None:
        return None, f"a battery at {battery.percent:.0f}%, but whether it is plugged in is not reported"
    return bool(battery.power_plugged), f"battery {battery.percent:.0f}%"


def _temperature() -> tuple[float | None, str]:
    import psutil

    reader = getattr(psutil, "sensors_temperatures", None)
    if reader is None:
        return None, "psutil has no temperature reader on this platform"
    try:
        sensors = reader()
    except Exception as exc:  # noqa: BLE001 -- a sensor must never crash the app
        return None, f"reading the temperature sensors failed ({type(exc).__name__}: {exc})"
    readings = [(name, entry.current) for name, entries in (sensors or {}).items() for entry in entries
                if isinstance(entry.current, (int, float)) and entry.current > -273]
    if not readings:
        return None, "no temperature sensors reported (psutil.sensors_temperatures() is empty)"
    name, hottest = max(readings, key=lambda item: item[1])
    return float(hottest), f"hottest of {len(readings)} sensors ({name})"


def _memory() -> tuple[int | None, str]:
    import psutil

    try:
        return int(psutil.virtual_memory().available), "psutil.virtual_memory().available"
    except Exception as exc:  # noqa: BLE001 -- a sensor must never crash the app
        return None, f"reading free memory failed ({type(exc).__name__}: {exc})"


def _jtop_readings() -> tuple[bool | None, float | None, str]:
    """(on power, hottest temperature, note) from jetson-stats' service; Nones and why when it cannot answer."""
    try:
        from jtop import jtop
    except ImportError as exc:
        return None, None, f"a Jetson, but jetson-stats is not installed ({exc}): pip install 'edgetrain[jetson]'"
    try:
        with jtop() as client:
            temperatures = [float(value.get("temp")) for value in (client.temperature or {}).values()
                            if isinstance(value, dict) and value.get("online", True)
                            and isinstance(value.get("temp"), (int, float)) and value.get("temp") > -256]
            power = client.power or {}
            total = power.get("tot", {}).get("power") if isinstance(power.get("tot"), dict) else None
    except Exception as exc:  # noqa: BLE001 -- jtop raises its own JtopException, socket errors, ...
        return None, None, f"a Jetson, but the jtop service did not answer ({type(exc).__name__}: {exc})"
    note = "jtop" + (f": {total / 1000:.1f} W drawn" if isinstance(total, (int, float)) else "")
    return True, (max(temperatures) if temperatures else None), note


class SystemSensors:
    """The device's own readings (psutil; jtop on a Jetson). Never raises."""

    def __init__(self, use_jtop: bool = True) -> None:
        self.use_jtop = use_jtop

    def read(self) -> Readings:
        notes: dict[str, str] = {}
        on_power, notes["on_power"] = _battery()
        temperature, notes["temperature_c"] = _temperature()
        available, notes["available_bytes"] = _memory()
        if self.use_jtop:
            from edgetrain.backends.host import is_jetson  # here: importing edgetrain.backends loads torch

            if is_jetson():
                jetson_power, jetson_temperature, note = _jtop_readings()
                if jetson_power is not None and on_power is None:
                    on_power, notes["on_power"] = jetson_power, note
                if jetson_temperature is not None:
                    temperature, notes["temperature_c"] = jetson_temperature, note
                if jetson_power is None:
                    notes["jetson"] = note
            else:
                notes["jetson"] = "not an NVIDIA Jetson: jtop not used"
        return Readings(on_power, temperature, available, notes)


def as_sensors(sensors: Any) -> Sensors:
    """None -> the real readers; an object with read(); or a callable returning Readings."""
    if sensors is None:
        return SystemSensors()
    if callable(getattr(sensors, "read", None)):
        return sensors
    if callable(sensors):
        class _Call:
            def read(self) -> Readings:
                return sensors()
        return _Call()
    from edgetrain.personalise.errors import PersonaliseError

    raise PersonaliseError(f"sensors must have a read() method returning Readings (or be a callable), "
                           f"got {type(sensors).__name__}")
