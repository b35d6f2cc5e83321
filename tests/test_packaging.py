"""What a regular (non-editable) install of the wheel carries: the device profiles of targets/."""
from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, **kwargs)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    return result


def test_an_installed_wheel_finds_every_device_target(tmp_path):
    pytest.importorskip("setuptools", reason="building the wheel needs setuptools in this environment")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "wheel"),
         str(REPO)])
    prefix = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(prefix)])
    wheel = next((tmp_path / "wheel").glob("edgetrain-*.whl"))
    # The new environment's own pip: this environment's pip with --prefix would first uninstall the
    # edgetrain installed here (pip replaces a distribution it finds in the environment it runs in).
    run([str(prefix / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)])
    # The new environment borrows this one's dependencies (torch, ...) but not its editable edgetrain:
    # PYTHONPATH entries are not site directories, so the editable install's .pth hook is not run there.
    dependencies = [sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
    expected = sorted(p.stem for p in (REPO / "targets").glob("*.toml"))
    result = run([str(prefix / "bin" / "python"), "-c",
                  "import edgetrain, edgetrain.targets as t; print(edgetrain.__file__); print(t.targets_directory()); "
                  "print(','.join(t.available_targets())); "
                  "print(sum(t.load_target(n).memory_budget_mib > 0 for n in t.available_targets()))"],
                 cwd=tmp_path, env={"PYTHONPATH": ":".join(dependencies), "PATH": "/usr/bin:/bin"})
    module, directory, names, loaded = result.stdout.split()
    assert Path(module).is_relative_to(prefix)  # the installed copy, not the checkout
    assert Path(directory) == prefix / "share" / "edgetrain" / "targets"
    assert names.split(",") == expected and int(loaded) == len(expected)
    # Building and installing elsewhere left this environment's edgetrain where it was.
    here = run([sys.executable, "-c", "import edgetrain; print(edgetrain.__file__)"], cwd=tmp_path)
    assert Path(here.stdout.strip()).resolve() == (REPO / "edgetrain" / "__init__.py").resolve() or \
        not Path(here.stdout.strip()).is_relative_to(prefix)
