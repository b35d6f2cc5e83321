"""What a regular (non-editable) install of the wheel carries: the device profiles (package data), the
compiled tile kernel, and nothing that only the tests use."""
from __future__ import annotations

import os
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
    # Without PYTHONPATH: a checkout on it would make pip find edgetrain "already installed".
    run([str(prefix / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        env={name: value for name, value in os.environ.items() if name != "PYTHONPATH"})
    # The new environment borrows this one's dependencies (torch, ...) but not its editable edgetrain:
    # PYTHONPATH entries are not site directories, so the editable install's .pth hook is not run there.
    dependencies = [sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
    expected = sorted(p.stem for p in (REPO / "edgetrain" / "targets" / "profiles").glob("*.toml"))
    result = run([str(prefix / "bin" / "python"), "-c",
                  "import edgetrain, edgetrain.targets as t; print(edgetrain.__file__); print(t.targets_directory()); "
                  "print(','.join(t.available_targets())); "
                  "print(sum(t.load_target(n).memory_budget_mib > 0 for n in t.available_targets())); "
                  "from edgetrain.models import tile_kernel as k; print(k.available() and k._tile_kernel.__file__)"],
                 cwd=tmp_path, env={"PYTHONPATH": ":".join(dependencies), "PATH": "/usr/bin:/bin"})
    module, directory, names, loaded, kernel = result.stdout.split()
    # The packed matrices' tile kernel is compiled into the wheel (pyproject's ext-modules) and loads there.
    assert Path(kernel).is_relative_to(prefix) and Path(kernel).name.startswith("_tile_kernel."), kernel
    assert Path(module).is_relative_to(prefix)  # the installed copy, not the checkout
    assert Path(directory).is_relative_to(prefix) and Path(directory).name == "profiles"
    assert names.split(",") == expected and int(loaded) == len(expected)
    # Building and installing elsewhere left this environment's edgetrain where it was.
    here = run([sys.executable, "-c", "import edgetrain; print(edgetrain.__file__)"], cwd=tmp_path)
    assert Path(here.stdout.strip()).resolve() == (REPO / "edgetrain" / "__init__.py").resolve() or \
        not Path(here.stdout.strip()).is_relative_to(prefix)


@pytest.mark.slow
def test_the_wheel_installs_with_only_its_declared_dependencies_and_trains(tmp_path):
    """A fresh venv, the wheel and what it declares (no extras; torch pinned by tools/constraints.txt, the
    rest from the package index): --version, `list methods` and one training step of a tiny model."""
    pytest.importorskip("setuptools", reason="building the wheel needs setuptools in this environment")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "wheel"),
         str(REPO)])
    wheel = next((tmp_path / "wheel").glob("edgetrain-*.whl"))
    prefix = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(prefix)])
    find_links = ["--find-links", "/opt/wheels"] if Path("/opt/wheels").is_dir() else []
    # Without PYTHONPATH: a checkout on it would make pip find edgetrain "already installed".
    clean = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    install = subprocess.run([str(prefix / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                              "-c", str(REPO / "tools" / "constraints.txt"), *find_links, str(wheel)],
                             capture_output=True, text=True, timeout=900, env=clean)
    if install.returncode != 0 and any(sign in install.stderr for sign in (
            "Could not find a version", "No matching distribution", "NewConnectionError", "Temporary failure")):
        pytest.skip("installing the wheel's dependencies needs the package index (offline here): "
                    + install.stderr.strip().splitlines()[-1])
    assert install.returncode == 0, install.stderr[-3000:]
    edgetrain_cli = str(prefix / "bin" / "edgetrain")
    env = {"PATH": f"{prefix / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)}
    version = run([edgetrain_cli, "--version"], cwd=tmp_path, env=env).stdout.strip()
    from edgetrain import __version__

    assert version == f"edgetrain {__version__}"
    methods = run([edgetrain_cli, "list", "methods"], cwd=tmp_path, env=env).stdout
    assert {"bp", "mesp", "mezo", "fgd"} <= {line.split()[0] for line in methods.splitlines()}
    # No dev extra: neither the test tools nor the optional dependencies came along.
    missing = run([str(prefix / "bin" / "python"), "-c", "import importlib.util as u; "
                   "print([m for m in ('pytest', 'sklearn', 'matplotlib', 'mlx') if u.find_spec(m)])"],
                  cwd=tmp_path, env=env).stdout.strip()
    assert missing == "[]"
    # A checkpoint's own tokenizer.json loads (tokenizers is a declared dependency).
    from tokenizers import Tokenizer, models, pre_tokenizers

    word_level = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "device": 2}, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    word_level.save(str(tmp_path / "tokenizer.json"))
    ids = run([str(prefix / "bin" / "python"), "-c", "from edgetrain.data.tokenizer import load_tokenizer; "
               f"print(load_tokenizer({str(tmp_path / 'tokenizer.json')!r}).encode('hello device'))"],
              cwd=tmp_path, env=env).stdout.strip()
    assert ids == "[1, 2]"
    trained = run([edgetrain_cli, "train", "--model", "tiny", "--method", "mesp", "--steps", "1", "--seq", "16",
                   "--batch", "2", "--rank", "2"], cwd=tmp_path, env=env)
    assert "step 1" in trained.stdout or "step 1" in trained.stderr, trained.stdout[-2000:] + trained.stderr[-2000:]
    # The profiler runs each method in a child process of the installed package.
    profiled = run([edgetrain_cli, "profile", "--model", "tiny", "--methods", "bp", "--steps", "1", "--seq", "16",
                    "--batch", "2", "--no-fidelity"], cwd=tmp_path, env=env)
    assert "bp" in profiled.stdout and "ratios are to bp" in profiled.stdout, profiled.stdout[-2000:]
