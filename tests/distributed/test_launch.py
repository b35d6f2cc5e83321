"""edgetrain.distributed.launch: the torchrun command line; a run whose worker dies of SIGABRT is run again
once (with a warning), a worker's own Python error is not; a timeout leaves no worker behind."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from edgetrain.distributed.launch import (
    REPO_ROOT,
    run_torchrun,
    signal_death,
    torchrun_command,
    worker_env,
)
from edgetrain.registry import EdgetrainError

WORKERS = str(Path(__file__).resolve().parent / "workers")

# The summary torchrun printed when CI's SCPL pipeline worker aborted (trimmed).
CI_SUMMARY = """edgetrain.distributed.scpl_pipeline FAILED
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 1336)  (SIGTERM)
[2]:
  rank      : 2 (local_rank: 2)
  exitcode  : -15 (pid: 1338)  (SIGTERM)
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 1337)  (SIGABRT)
  traceback : Signal 6 (SIGABRT) received by PID 1337
"""
PYTHON_ERROR_SUMMARY = """Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 77)
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
"""


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
    assert signal_death(CI_SUMMARY) == "rank 1 died of SIGABRT"
    assert signal_death(PYTHON_ERROR_SUMMARY) is None
    assert signal_death(CI_SUMMARY.split("Root Cause")[0]) is None  # only SIGTERMs: torchrun stopping the rest
    assert signal_death("something torchrun never prints") is None


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
    assert signal_death(done.stderr) == "rank 1 died of SIGABRT"


def test_a_python_error_is_not_run_again(tmp_path, worker_path):
    out, marker = tmp_path / "report.json", tmp_path / "marker"
    done = run_torchrun(2, "abort_once", [str(out), str(marker), "python-error"], timeout=120)
    assert done.returncode != 0 and done.attempts == 1 and not out.exists()
    assert "a bug of the worker's own" in done.stderr


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
