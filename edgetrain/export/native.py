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
_STEP = re.compile(r"^step (\d+) loss (\S+)$")


@dataclass
class RunnerResult:
    losses: list[float]
    parameters: dict[str, torch.Tensor] = field(default_factory=dict)
    output: str = ""


def build_runner(build_dir: str | Path, source_dir: str | Path = REPO, python: str | None = None) -> Path:
    """Configure and build the runner with CMake; returns the binary. Needs cmake, a C++17 compiler and
    the executorch wheel (its share/cmake config) in `python`'s environment."""
    cmake = shutil.which("cmake")
    if cmake is None:
        raise ExportError("building the native runner needs cmake (pip install cmake, or apt-get install cmake)")
    build_dir = Path(build_dir)
    configure = [cmake, "-S", str(source_dir), "-B", str(build_dir), f"-DPython3_EXECUTABLE={python or sys.executable}"]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"] if not (build_dir / "CMakeCache.txt").exists() else []
    for command in (configure, [cmake, "--build", str(build_dir), "--target", RUNNER]):
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise ExportError(f"{' '.join(command[:2])} failed:\n{(result.stdout + result.stderr)[-3000:]}")
    return build_dir / RUNNER


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
        raise ExportError(f"{Path(binary).name} failed ({result.returncode}): "
                          f"{result.stderr.strip().splitlines()[-1] if result.stderr.strip() else result.stdout}")
    losses = []
    for line in result.stdout.splitlines():
        match = _STEP.match(line.strip())
        if match:
            # Printed with 9 significant digits, which identify a float32 exactly: round back to it.
            losses.append(struct.unpack("<f", struct.pack("<f", float(match.group(2))))[0])
    parameters = read_runner_parameters(save) if save is not None else {}
    return RunnerResult(losses, parameters, result.stdout)
