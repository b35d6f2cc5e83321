"""SIGKILL at random points, resume from the last checkpoint: the same weights, bit for bit.

Each run is a real `edgetrain train` process with a checkpoint after every step; the killed run is
killed at random moments inside its training loop (also during checkpoint writes) and restarted
until it finishes.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from edgetrain.training.checkpoint import load_latest_good
from edgetrain.methods import METHODS
from fault_tally import checked

STEPS = 10


def _command(method: str, directory) -> list[str]:
    optimizer = "sgd" if method in ("mezo", "fgd") else "adamw"
    return [sys.executable, "-m", "edgetrain.cli", "train", "--model", "tiny", "--method", method, "--seq", "32",
            "--batch", "2", "--rank", "4", "--steps", str(STEPS), "--optimizer", optimizer, "--lr", "1e-3",
            "--checkpoint-dir", str(directory), "--checkpoint-every", "1", "--seed", "5", "--quiet",
            # One fixed count for every step of every run: the default, auto, would take fewer threads while
            # the machine is busy, and a thread count can change the rounding of a reduction.
            "--threads", "1"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"  # the same thread count in every run: the same float reductions
    return env


def _final_params(directory) -> dict[str, torch.Tensor]:
    path, tensors, metadata = load_latest_good(directory, warn=lambda m: None)
    assert path.name == f"step-{STEPS:08d}.safetensors"
    return {k: v for k, v in tensors.items() if k.startswith(("param/", "optimizer/"))}


def _newest_step(directory) -> int:
    names = sorted(p.name for p in directory.glob("step-*.safetensors"))
    return int(names[-1][5:13]) if names else -1


def _run_with_kills(method: str, directory, kills: int, rng: random.Random) -> int:
    done_kills = 0
    for _ in range(kills + 3):
        process = subprocess.Popen(_command(method, directory), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   env=_env())
        if done_kills < kills:
            start_step = _newest_step(directory)
            deadline = time.monotonic() + 300  # a busy machine: only a hang should fail here
            while _newest_step(directory) <= start_step and process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 0.4))
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
                process.wait()
                done_kills += 1
                continue
        _, err = process.communicate(timeout=120)
        assert process.returncode == 0, err
        if _newest_step(directory) == STEPS:
            return done_kills
    pytest.fail(f"{method}: the killed run never finished")


@pytest.mark.parametrize("method", ["bp", "mebp", "mesp", "mezo", "fgd"])
def test_killed_and_resumed_equals_uninterrupted(method, tmp_path):
    if method not in METHODS:
        pytest.skip(f"method {method!r} is not registered in this build")
    straight = tmp_path / "straight"
    result = subprocess.run(_command(method, straight), capture_output=True, text=True, env=_env(), timeout=300)
    assert result.returncode == 0, result.stderr
    killed = tmp_path / "killed"
    with checked("kills and crashes"):
        kills = _run_with_kills(method, killed, kills=2, rng=random.Random(method))
        assert kills >= 1
        expected, got = _final_params(straight), _final_params(killed)
        assert expected.keys() == got.keys() and any(k.startswith("param/") for k in expected)
        for name in expected:
            assert torch.equal(expected[name], got[name]), f"{method}: {name} differs after {kills} kills"
    print(f"\n{method}: killed {kills}x with SIGKILL, resumed; {len(expected)} tensors bit-identical "
          f"to the uninterrupted run after {STEPS} steps")
