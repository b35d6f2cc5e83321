"""Run each (method, config) in a fresh subprocess and collect its record.

Isolation is the point: a method's allocator caches and high-water marks die with its process. The
child gets glibc's mmap threshold fixed through its environment, so large freed blocks go back to
the OS and the per-step RSS high-water mark is repeatable.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from edgetrain.profiler.config import ProfileConfig
from edgetrain.profiler.worker import RESULT_MARKER
from edgetrain.registry import EdgetrainError


class ProfileError(EdgetrainError, RuntimeError):
    """A profiled method failed in its subprocess; the message carries the child's error."""


def _child_environment() -> dict[str, str]:
    from edgetrain.probes.glibc import malloc_threshold_env

    env = dict(os.environ)
    env.update(malloc_threshold_env())
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_isolated(config: ProfileConfig, on_progress: Callable[[str], None] = lambda line: None,
                 timeout_s: float | None = None) -> dict[str, Any]:
    command = [sys.executable, "-m", "edgetrain.profiler.worker", json.dumps(config.to_dict())]
    # Its own session, so that Ctrl-C here can end the child and anything it started.
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=_child_environment(), start_new_session=True)
    stderr_tail: list[str] = []

    def forward_progress() -> None:
        for line in child.stderr:
            stderr_tail.append(line)
            del stderr_tail[:-40]
            on_progress(line.rstrip("\n"))

    stdout_lines: list[str] = []

    def collect_stdout() -> None:
        stdout_lines.extend(child.stdout)

    # Each pipe has exactly one reader (communicate() would read stderr too, racing the forwarder).
    readers = [threading.Thread(target=forward_progress, daemon=True),
               threading.Thread(target=collect_stdout, daemon=True)]
    for reader in readers:
        reader.start()
    try:
        _wait_interruptibly(child, timeout_s)
    except BaseException:  # KeyboardInterrupt, timeout: leave no orphan behind
        _terminate(child)
        raise
    for reader in readers:
        reader.join(timeout=5)
    for line in reversed("".join(stdout_lines).splitlines()):
        if line.startswith(RESULT_MARKER):
            record = json.loads(line[len(RESULT_MARKER):])
            if "error" in record:
                raise ProfileError(f"method {config.method!r} failed: {record['error']}")
            return record
    raise ProfileError(f"method {config.method!r}: the profiling subprocess died (exit code "
                       f"{child.returncode}) without a result; its last output:\n" + "".join(stderr_tail))


def _wait_interruptibly(child: subprocess.Popen, timeout_s: float | None) -> None:
    """Wait for the child in short slices: Ctrl-C may be delivered to a reader thread, and a main
    thread blocked in one long waitpid() would not run Python's SIGINT handler until the child ends."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        slice_s = 0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic()))
        try:
            child.wait(timeout=slice_s)
            return
        except subprocess.TimeoutExpired:
            if deadline is not None and time.monotonic() >= deadline:
                raise


def _terminate(child: subprocess.Popen) -> None:
    if child.poll() is not None:
        return
    try:
        os.killpg(child.pid, signal.SIGTERM)
        child.wait(timeout=5)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.wait()
