"""Build and drive the native ExecuTorch training runner (targets/executorch/runner.cpp) from Python.

    binary = build_runner("build/native")              # cmake configure + build (top-level CMakeLists.txt)
    run = run_runner(binary, "head.pte", "batches.bin", lr=0.1, save="trained.safetensors")
    run.losses, run.parameters                           # the loss of every step, the trained weights
"""
from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from edgetrain.export.stream_file import read_runner_parameters
from edgetrain.export.trainable import ExportError

REPO = Path(__file__).resolve().parents[2]
RUNNER = "edgetrain_et_runner"
MESP_RUNNER = "edgetrain_mesp_runner"
# The native runners' exit statuses other than 0 (the headers of targets/executorch/runner.cpp and
# mesp_runner.cpp; targets/executorch/runner_io.h's run_main maps the refusals to them).
RUNNER_EXIT_STATUS = {1: "internal error", 2: "usage", 3: "a bad, damaged or mismatched input",
                      4: "an output that cannot be written", 5: "a non-finite step"}
MESP_EXIT_STATUS = RUNNER_EXIT_STATUS
_STEP = re.compile(r"^step (\d+) loss (\S+)$")


@dataclass
class RunnerResult:
    losses: list[float]
    parameters: dict[str, torch.Tensor] = field(default_factory=dict)
    output: str = ""


def build_runner(build_dir: str | Path, source_dir: str | Path = REPO, python: str | None = None,
                 target: str = RUNNER) -> Path:
    """Configure and build the runner with CMake; returns the binary. Needs cmake, a C++17 compiler and
    the executorch wheel (its share/cmake config) in `python`'s environment."""
    cmake = shutil.which("cmake")
    if cmake is None:
        raise ExportError("building the native runner needs cmake (pip install cmake, or apt-get install cmake)")
    build_dir = Path(build_dir)
    configure = [cmake, "-S", str(source_dir), "-B", str(build_dir), f"-DPython3_EXECUTABLE={python or sys.executable}"]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"] if not (build_dir / "CMakeCache.txt").exists() else []
    for command in (configure, [cmake, "--build", str(build_dir), "--target", target]):
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise ExportError(f"{' '.join(command[:2])} failed:\n{(result.stdout + result.stderr)[-3000:]}")
    return build_dir / target


def run_runner(binary: str | Path, program: str | Path, batches: str | Path, lr: float, *,
               steps: int | None = None, save: str | Path | None = None, timeout: float = 600) -> RunnerResult:
    command = [str(binary), str(program), str(batches), "--lr", repr(lr)]
    if steps is not None:
        command += ["--steps", str(steps)]
    if save is not None:
        command += ["--save", str(save)]
    # The runtime logs CPU detection at INFO on stderr; the runner's own output is on stdout.
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    if result.returncode != 0:
        # The runtime's own log lines share stderr with the runner's one sentence: name that one.
        errors = [line for line in result.stderr.splitlines() if line.startswith(f"{Path(binary).name}:")]
        error = errors[-1] if errors else (result.stderr.strip()[-500:] or result.stdout[-500:])
        raise ExportError(f"{Path(binary).name} exited with {result.returncode} "
                          f"({RUNNER_EXIT_STATUS.get(result.returncode, 'killed')}): {error}")
    losses = []
    for line in result.stdout.splitlines():
        match = _STEP.match(line.strip())
        if match:
            # Printed with 9 significant digits, which identify a float32 exactly: round back to it.
            losses.append(struct.unpack("<f", struct.pack("<f", float(match.group(2))))[0])
    parameters = read_runner_parameters(save) if save is not None else {}
    return RunnerResult(losses, parameters, result.stdout)


@dataclass
class MeSPRunnerResult:
    returncode: int
    losses: list[float]
    adapter: dict[str, torch.Tensor] = field(default_factory=dict)
    output: str = ""
    error: str = ""


def run_mesp_runner(binary: str | Path, program: str | Path, batches: str | Path, *, lr: float | None = None,
                    steps: int | None = None, checkpoint: str | Path | None = None, save: str | Path | None = None,
                    weights: str | Path | None = None, weight_decay: float | None = None, check: bool = True,
                    timeout: float = 1800) -> MeSPRunnerResult:
    """Run edgetrain_mesp_runner; with `check`, a non-zero exit raises ExportError naming its cause. The saved
    adapter is read back as edgetrain reads any adapter file (its checksum verified)."""
    command = [str(binary), str(program), str(batches)]
    for flag, value in (("--lr", lr), ("--steps", steps), ("--checkpoint", checkpoint), ("--save", save),
                        ("--weights", weights), ("--weight-decay", weight_decay)):
        if value is not None:
            command += [flag, repr(value) if isinstance(value, float) else str(value)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    errors = [line for line in result.stderr.splitlines() if "edgetrain_mesp_runner" in line]
    error = errors[-1] if errors else result.stderr.strip()[-500:]
    if check and result.returncode != 0:
        raise ExportError(f"{Path(binary).name} exited with {result.returncode} "
                          f"({RUNNER_EXIT_STATUS.get(result.returncode, 'killed')}): {error}")
    losses = [struct.unpack("<f", struct.pack("<f", float(m.group(2))))[0]
              for m in (_STEP.match(line.strip()) for line in result.stdout.splitlines()) if m]
    adapter = {}
    if save is not None and result.returncode == 0:
        from edgetrain.models.lora import read_lora_file

        adapter = read_lora_file(save)[1]
    return MeSPRunnerResult(result.returncode, losses, adapter, result.stdout, error)
