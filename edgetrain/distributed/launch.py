"""Starting torchrun on this machine from Python: the tests, the benchmarks under tools/ and the samples
run every distributed method this way (`--standalone`, N worker processes on localhost).

One retry, for one kind of failure only: a worker killed by a signal other than the launcher's own
SIGTERM/SIGKILL. CI once saw a gloo worker of the SCPL pipeline abort with "terminate called without an
active exception" -- SIGABRT from inside the C++ transport, no Python traceback, and not reproduced in
~120 local runs of the same test (up to 3 at a time on 2 cores). Every entry point started here seeds its
model and data and starts from scratch, so a fresh torchrun computes the same result. A worker that fails for a reason of its own (a
Python exception, exit code 1) is not rerun: its error comes back at once. The retry is never silent: it
raises a RuntimeWarning naming the rank and the signal, and `TorchrunResult.attempts` says 2.

torchrun's own `--max-restarts` is not used: the group it restarted inside the same agent failed in 2 of 4
tries here (once both new workers hung in init_process_group, in gloo's connect; once it exited 1).

A run that outlives its timeout is killed with all its workers, so none is left behind holding a port.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from edgetrain.registry import EdgetrainError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RETRIES = 1
# torchrun's failure summary, one block per failed rank: "rank      : 1 (local_rank: 1)" ... "exitcode  : -6"
_FAILURE = re.compile(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.DOTALL)
_LAUNCHER_SIGNALS = {signal.SIGTERM, signal.SIGKILL}  # how torchrun stops the others once one has failed


@dataclass
class TorchrunResult:
    returncode: int
    stdout: str
    stderr: str
    attempts: int = 1
    retried_because: str | None = None  # "rank 1 died of SIGABRT" when the first attempt was rerun


def torchrun_command(num_workers: int, module: str, argv: Sequence[str], *,
                     python: str = sys.executable) -> list[str]:
    """The command line that runs `python -m module argv...` in `num_workers` processes on localhost."""
    if num_workers < 1:
        raise EdgetrainError(f"torchrun needs at least one worker, got {num_workers}")
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={num_workers}",
            "-m", module, *argv]


def worker_env(threads_per_worker: int = 1) -> dict[str, str]:
    """This process's environment for the workers: N processes share the cores, so each gets
    `threads_per_worker` OpenMP/MKL threads, and the repository is importable wherever they start."""
    path = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**os.environ, "OMP_NUM_THREADS": str(threads_per_worker), "MKL_NUM_THREADS": str(threads_per_worker),
            "PYTHONPATH": path}


def signal_death(stderr: str) -> str | None:
    """'rank R died of SIGNAME' when torchrun's summary shows a worker killed by a signal the launcher did not
    send (the first such rank), else None -- a Python error, a clean exit, or a summary we cannot read."""
    for rank, exitcode in _FAILURE.findall(stderr.split("Root Cause", 1)[-1] if "Root Cause" in stderr else stderr):
        code = int(exitcode)
        if code < 0:
            try:
                sig = signal.Signals(-code)
            except ValueError:
                return f"rank {rank} died of signal {-code}"
            if sig not in _LAUNCHER_SIGNALS:
                return f"rank {rank} died of {sig.name}"
    return None


def _run_once(command: list[str], env: dict[str, str], cwd: str | Path | None, timeout: float,
              what: str) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        kill_tree(proc.pid)
        proc.communicate()
        raise EdgetrainError(f"{what} did not finish in {timeout:.0f} s (torchrun and its workers were killed)") from exc
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants. torchrun starts every worker in a session of its own, so
    neither killing torchrun nor its process group reaches them; they would live on holding the pipes."""
    import psutil

    try:
        root = psutil.Process(pid)
        family = [*root.children(recursive=True), root]  # before the kill: orphans are re-parented to init
    except psutil.NoSuchProcess:
        return
    for process in family:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=10)


def run_torchrun(num_workers: int, module: str, argv: Sequence[str], *, timeout: float,
                 threads_per_worker: int = 1, retries: int = DEFAULT_RETRIES, python: str = sys.executable,
                 cwd: str | Path | None = None) -> TorchrunResult:
    """Run torchrun to completion (output captured as text) and return its exit code and output; the caller
    reads the exit code. A run whose worker died of a signal is rerun up to `retries` times, with a warning.
    A run that outlives `timeout` seconds (each attempt) is killed and raises EdgetrainError."""
    if retries < 0:
        raise EdgetrainError(f"retries must be >= 0, got {retries}")
    command = torchrun_command(num_workers, module, argv, python=python)
    what = f"torchrun {module} with {num_workers} workers"
    env = worker_env(threads_per_worker)
    done, attempts, reason = _run_once(command, env, cwd, timeout, what), 1, None
    while done.returncode != 0 and attempts <= retries and (death := signal_death(done.stderr)):
        warnings.warn(f"{what}: {death} (no Python error); running it again from the start", RuntimeWarning,
                      stacklevel=2)
        done, attempts, reason = _run_once(command, env, cwd, timeout, what), attempts + 1, death
    return TorchrunResult(done.returncode, done.stdout, done.stderr, attempts, reason)
