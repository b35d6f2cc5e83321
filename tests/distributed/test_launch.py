"""edgetrain.distributed.launch: the torchrun command line; a run whose worker dies of SIGABRT (as torch
elastic's failure record says) is run again once, with a warning; a worker's own Python error is not; a
timeout leaves no worker behind."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from edgetrain.distributed.elastic_run import failure_record
from edgetrain.distributed.launch import (
    REPO_ROOT,
    run_torchrun,
    signal_death,
    torchrun_command,
    worker_env,
)
from edgetrain.registry import EdgetrainError

WORKERS = str(Path(__file__).resolve().parent / "workers")



def ci_failure(root_exitcode: int = -6) -> ChildFailedError:
    """torch.distributed.elastic's record of what CI saw when an SCPL pipeline worker aborted: rank 1 died
    first (SIGABRT inside gloo), then the launcher stopped ranks 0 and 2 with SIGTERM."""
    failures = {0: ProcessFailure(0, 1336, -15, ""), 2: ProcessFailure(2, 1338, -15, ""),
                1: ProcessFailure(1, 1337, root_exitcode, "")}
    for rank, failure in failures.items():
        failure.timestamp = 1000 + (0 if rank == 1 else 5)
    return ChildFailedError("edgetrain.recipes.scpl_pipeline", failures)


def test_the_command_runs_the_module_standalone():
    assert torchrun_command(3, "pkg.mod", ["--x", "1"], python="py") == [
        "py", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", "-m", "pkg.mod", "--x", "1"]
    with pytest.raises(EdgetrainError, match="at least one worker"):
        torchrun_command(0, "m", [])
    with pytest.raises(EdgetrainError, match="retries must be >= 0"):
        run_torchrun(1, "m", [], timeout=1, retries=-1)


def test_workers_get_the_thread_count_and_the_repository_on_their_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = worker_env(3)
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "3"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO_ROOT), "/elsewhere"]
    monkeypatch.delenv("PYTHONPATH")
    assert worker_env()["PYTHONPATH"] == str(REPO_ROOT)


def test_signal_deaths_are_told_from_python_errors_and_the_launchers_sigterm():
    record = failure_record(ci_failure())
    assert record["first_rank"] == 1 and record["failures"]["1"]["signal"] == "SIGABRT"
    assert signal_death(record) == "rank 1 died of SIGABRT"
    assert signal_death(failure_record(ci_failure(root_exitcode=1))) is None  # a Python error: exit code 1
    assert signal_death(failure_record(ci_failure(root_exitcode=-15))) is None  # only the launcher's SIGTERMs
    assert signal_death(failure_record(ci_failure(root_exitcode=-99))) == "rank 1 died of signal 99"
    assert signal_death(None) is None  # no record: torchrun itself failed before any worker ran
    assert signal_death({"first_rank": 3, "failures": {}}) is None


@pytest.fixture
def worker_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", WORKERS)


def test_a_worker_killed_by_sigabrt_is_run_again_once(tmp_path, worker_path):
    out, marker = tmp_path / "report.json", tmp_path / "marker"
    with pytest.warns(RuntimeWarning, match="rank 1 died of SIGABRT"):
        done = run_torchrun(2, "abort_once", [str(out), str(marker)], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (done.attempts, done.retried_because) == (2, "rank 1 died of SIGABRT")
    assert json.loads(out.read_text()) == {"world_size": 2}


def test_without_retries_the_abort_fails_the_run(tmp_path, worker_path):
    out, marker = tmp_path / "report.json", tmp_path / "marker"
    done = run_torchrun(2, "abort_once", [str(out), str(marker)], timeout=120, retries=0)
    assert done.returncode != 0 and done.attempts == 1 and not out.exists()
    assert signal_death(done.failures) == "rank 1 died of SIGABRT"
    assert "SIGABRT" in done.stderr  # torchrun's own summary is still there for people


def test_a_python_error_is_not_run_again(tmp_path, worker_path):
    out, marker = tmp_path / "report.json", tmp_path / "marker"
    done = run_torchrun(2, "abort_once", [str(out), str(marker), "python-error"], timeout=120)
    assert done.returncode != 0 and done.attempts == 1 and not out.exists()
    assert "a bug of the worker's own" in done.stderr
    assert done.failures["failures"]["1"]["exitcode"] == 1


def test_a_timeout_kills_the_workers_too(tmp_path, worker_path):
    pids = tmp_path / "pids"
    with pytest.raises(EdgetrainError, match="did not finish in 20 s"):
        run_torchrun(2, "sleep_forever", [str(pids)], timeout=20)
    written = [int(p) for p in pids.read_text().split()]
    assert len(written) == 2
    deadline = time.monotonic() + 10  # killed at once; init may take a moment to reap them
    while any(alive(pid) for pid in written) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in written)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
