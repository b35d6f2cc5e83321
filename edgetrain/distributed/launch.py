"""Starting torchrun on this machine from Python: the tests, the benchmarks under tools/ and the samples
run every distributed method this way (`--standalone`, N worker processes on localhost).

One retry, for one kind of failure only: the first worker to fail was killed by a signal other than the
launcher's own SIGTERM/SIGKILL (a C++ abort inside the transport, with no Python error to report). Every
entry point started here seeds its model and data and starts from scratch, so a fresh torchrun computes the
same result. A worker that fails for a reason of its own (a Python exception, exit code 1) is not rerun.
The retry is never silent: it raises a RuntimeWarning naming the rank and the signal, and
`TorchrunResult.attempts` says 2. The decision reads torch.distributed.elastic's own record of the failure
(exit code and signal of each rank, which failed first), written as JSON by edgetrain.distributed.elastic_run.

torchrun's own `--max-restarts` is not used (the launcher row of docs/reliability.md says why). A run that
outlives its timeout is killed with all its workers, so none is left behind holding a port.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgetrain.registry import EdgetrainError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RETRIES = 1
_LAUNCHER_SIGNALS = {signal.SIGTERM, signal.SIGKILL}  # how torchrun stops the others once one has failed


@dataclass
class TorchrunResult:
    returncode: int
    stdout: str
    stderr: str
    attempts: int = 1
    retried_because: str | None = None  # "rank 1 died of SIGABRT" when the first attempt was rerun
    failures: dict[str, Any] | None = None  # the last attempt's failure record (elastic_run.failure_record)


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


def signal_death(failures: dict[str, Any] | None) -> str | None:
    """'rank R died of SIGNAME' when the first rank to fail was killed by a signal the launcher did not send,
    else None: a Python error, a clean exit, or no record at all (torchrun itself failed)."""
    if not failures or str(failures.get("first_rank")) not in failures.get("failures", {}):
        return None
    rank = str(failures["first_rank"])
    code = failures["failures"][rank]["exitcode"]
    if not isinstance(code, int) or code >= 0:
        return None
    try:
        sig = signal.Signals(-code)
    except ValueError:
        return f"rank {rank} died of signal {-code}"
    return None if sig in _LAUNCHER_SIGNALS else f"rank {rank} died of {sig.name}"


def _run_once(torchrun: list[str], env: dict[str, str], cwd: str | Path | None, timeout: float,
              what: str) -> tuple[subprocess.CompletedProcess, dict[str, Any] | None]:
    """One torchrun command line, run by elastic_run (the same launch, plus a JSON record of the failures),
    and that record when workers failed."""
    python, torchrun_args = torchrun[0], torchrun[3:]  # [python, "-m", "torch.distributed.run", *args]
    with tempfile.TemporaryDirectory(prefix="edgetrain-torchrun-") as tmp:
        record = Path(tmp) / "failures.json"
        command = [python, "-m", "edgetrain.distributed.elastic_run", str(record), *torchrun_args]
        proc = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            kill_tree(proc.pid)
            proc.communicate()
            raise EdgetrainError(f"{what} did not finish in {timeout:.0f} s (torchrun and its workers were killed)") \
                from exc
        failures = json.loads(record.read_text()) if record.is_file() else None
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr), failures


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
    (done, failures), attempts, reason = _run_once(command, env, cwd, timeout, what), 1, None
    while done.returncode != 0 and attempts <= retries and (death := signal_death(failures)):
        warnings.warn(f"{what}: {death} (no Python error); running it again from the start", RuntimeWarning,
                      stacklevel=2)
        (done, failures), attempts, reason = _run_once(command, env, cwd, timeout, what), attempts + 1, death
    return TorchrunResult(done.returncode, done.stdout, done.stderr, attempts, reason, failures)
