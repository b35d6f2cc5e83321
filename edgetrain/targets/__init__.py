"""Device profiles: backend, probe, dtype, default methods and a memory budget for one kind of device.

The shipped profiles are package data (profiles/*.toml, read with importlib.resources, so a wheel, a zip
or an editable install find them the same way); $EDGETRAIN_TARGETS_DIR replaces them with a directory of
one's own, and any path ending in .toml names a single profile.
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from edgetrain.registry import EdgetrainError

MIB = 2**20


def targets_directory() -> Traversable:
    """$EDGETRAIN_TARGETS_DIR, else the profiles shipped inside the package."""
    override = os.environ.get("EDGETRAIN_TARGETS_DIR")
    if override:
        return Path(override)
    return resources.files(__name__) / "profiles"


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    backend: str
    probe: str
    dtype: str
    memory_budget_mib: int  # what one training process may use, weights included
    default_methods: tuple[str, ...] = field(default_factory=tuple)

    @property
    def memory_budget_bytes(self) -> int:
        return self.memory_budget_mib * MIB

    def budget_warnings(self, records: list[dict[str, Any]]) -> list[str]:
        """One warning per profiled method whose weights + measured training peak exceed the budget."""
        warnings = []
        for record in records:
            peak = record.get("peak_bytes_probe") or record.get("peak_bytes_tensors") or 0
            total = peak + int(record.get("weights_bytes") or 0)
            if total > self.memory_budget_bytes:
                warnings.append(f"WARNING: {record['method']} needs about {total / MIB:,.0f} MiB (weights + "
                                f"training peak), over the {self.name} budget of {self.memory_budget_mib:,} MiB")
        return warnings


def available_targets() -> list[str]:
    directory = targets_directory()
    if not directory.is_dir():
        return []
    return sorted(entry.name.removesuffix(".toml") for entry in directory.iterdir()
                  if entry.name.endswith(".toml") and entry.is_file())


def load_target(name_or_path: str | Path) -> Target:
    """A shipped profile by name, or a profile file by its path (anything ending in .toml)."""
    path: Traversable = Path(name_or_path)
    if path.suffix != ".toml":
        # A name is one file of the profile directory, never a path out of it.
        if Path(name_or_path).name != str(name_or_path):
            raise EdgetrainError(f"target {str(name_or_path)!r}: a target is a name (see `edgetrain list "
                                 f"targets`) or a path ending in .toml")
        path = targets_directory() / f"{name_or_path}.toml"
    if not path.is_file():
        raise EdgetrainError(f"unknown target {str(name_or_path)!r}; known targets: "
                             f"{', '.join(available_targets()) or '(none found)'}")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise EdgetrainError(f"{path}: not valid TOML ({exc})") from None
    where = str(path)
    fields = {"description": str, "backend": str, "probe": str, "dtype": str, "memory_budget_mib": int}
    for key, kind in fields.items():
        if key not in raw:
            raise EdgetrainError(f"{where}: missing field {key!r}")
        if not isinstance(raw[key], kind) or isinstance(raw[key], bool):
            raise EdgetrainError(f"{where}: {key} must be {kind.__name__}, not {type(raw[key]).__name__}")
    default_methods = raw.get("default_methods", [])
    if not isinstance(default_methods, list) or not all(isinstance(m, str) for m in default_methods):
        raise EdgetrainError(f"{where}: default_methods must be a list of method names")
    target = Target(name=str(raw.get("name", path.name.removesuffix(".toml"))), description=raw["description"],
                    backend=raw["backend"], probe=raw["probe"], dtype=raw["dtype"],
                    memory_budget_mib=raw["memory_budget_mib"], default_methods=tuple(default_methods))
    if target.memory_budget_mib <= 0:
        raise EdgetrainError(f"{where}: memory_budget_mib must be positive")
    return target
