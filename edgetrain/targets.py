"""Device profiles (targets/*.toml): backend, probe, dtype, default methods and a memory budget."""
from __future__ import annotations

import os
import sysconfig
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgetrain.registry import EdgetrainError

MIB = 2**20


SOURCE_TARGETS = Path(__file__).resolve().parents[1] / "targets"  # a source checkout or an editable install


def installed_targets_directories() -> list[Path]:
    """Where a wheel puts the profiles (pyproject's data-files): <prefix>/share/edgetrain/targets, for the
    interpreter's prefix and for a --user install."""
    schemes = [sysconfig.get_default_scheme(), f"{os.name}_user"]
    return [Path(sysconfig.get_path("data", scheme)) / "share" / "edgetrain" / "targets"
            for scheme in schemes if scheme in sysconfig.get_scheme_names()]


def targets_directory() -> Path:
    """$EDGETRAIN_TARGETS_DIR, else the checkout's targets/, else the installed copy."""
    override = os.environ.get("EDGETRAIN_TARGETS_DIR")
    if override:
        return Path(override)
    for directory in (SOURCE_TARGETS, *installed_targets_directories()):
        if any(directory.glob("*.toml")):
            return directory
    return SOURCE_TARGETS


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
    return sorted(p.stem for p in directory.glob("*.toml")) if directory.is_dir() else []


def load_target(name_or_path: str | Path) -> Target:
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = targets_directory() / f"{name_or_path}.toml"
    if not path.is_file():
        raise EdgetrainError(f"unknown target {str(name_or_path)!r}; known targets: "
                             f"{', '.join(available_targets()) or '(none found)'}")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise EdgetrainError(f"{path}: not valid TOML ({exc})") from None
    try:
        target = Target(name=raw.get("name", path.stem), description=raw["description"], backend=raw["backend"],
                        probe=raw["probe"], dtype=raw["dtype"], memory_budget_mib=int(raw["memory_budget_mib"]),
                        default_methods=tuple(raw.get("default_methods", ())))
    except KeyError as exc:
        raise EdgetrainError(f"{path}: missing field {exc.args[0]!r}") from None
    if target.memory_budget_mib <= 0:
        raise EdgetrainError(f"{path}: memory_budget_mib must be positive")
    return target
