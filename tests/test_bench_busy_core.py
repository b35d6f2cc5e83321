"""tools/bench_busy_core.py, one short round: every arm runs, the busy core is killed afterwards, and the
auto arm ran on fewer threads than the cores beside it (a load the fitter must see). Timing is not checked."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from edgetrain.training.threads import usable_cores

REPO = Path(__file__).parent.parent


def _spinners() -> set[int]:
    """Busy-core spinners no running benchmark owns (one the other test's benchmark holds is its own)."""
    def owned(process: psutil.Process) -> bool:
        try:
            parent = process.parent()
            return parent is not None and any("bench_busy_core.py" in part for part in parent.cmdline())
        except psutil.Error:
            return False

    return {p.pid for p in psutil.process_iter(["cmdline"])
            if (p.info["cmdline"] or [])[-1:] == ["while True: pass"] and not owned(p)}


@pytest.mark.skipif(usable_cores() < 2, reason="the benchmark keeps one of at least 2 cores busy")
def test_one_round_runs_every_arm_and_leaves_no_spinner():
    # Spinners already running are someone else's (a busy machine made busy the same way): only new ones count.
    before = _spinners()
    done = subprocess.run([sys.executable, "tools/bench_busy_core.py", "--steps", "3", "--repeats", "1"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line[:34].strip(): line[34:].split() for line in done.stdout.splitlines() if line.startswith(("quiet", "busy"))}
    assert len(rows) == 5, done.stdout
    auto = rows["busy core, threads=auto"]
    assert float(auto[1]) < usable_cores()  # the thread count it ran on, averaged over its steps
    assert re.search(r"busy core, personaliser \(auto\)\s+[\d.]+\s+auto", done.stdout)
    assert _spinners() - before == set()


@pytest.mark.skipif(usable_cores() < 2, reason="the benchmark keeps one of at least 2 cores busy")
def test_the_cli_mode_times_train_processes_and_the_default_fits_its_threads():
    before = _spinners()
    done = subprocess.run([sys.executable, "tools/bench_busy_core.py", "--cli", "--steps", "3", "--repeats", "1",
                           "--warmup", "0", "--seq", "16", "--batch", "2"], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line[:38].strip(): line[38:].split() for line in done.stdout.splitlines() if line.startswith(("quiet", "busy"))}
    own = re.search(r"--threads (\d+) \(torch's\)", done.stdout).group(1)  # the bench's fresh process's count
    assert set(rows) == {f"{load}, {setting}" for load in ("quiet", "busy core")
                         for setting in (f"--threads {own} (torch's)", "--threads auto", "no --threads")}, done.stdout
    assert rows[f"busy core, --threads {own} (torch's)"][1] == f"{float(own):.1f}"  # a fixed count is logged as is
    assert float(rows["busy core, --threads auto"][1]) < usable_cores()  # the busy core was seen
    assert rows["busy core, no --threads"][1] != "torch"  # the default fits its threads (and logs the counts)
    assert all(row[3] == "1.00x" for name, row in rows.items() if "--threads auto" in name)
    assert _spinners() - before == set()


@pytest.mark.skipif(usable_cores() < 2, reason="compares 1 thread with every core")
def test_the_bits_mode_finds_what_a_thread_count_changes():
    """At seq 256 x batch 8 torch's CPU reductions split by thread: what the resume promise of --threads auto
    (docs/concepts.md) rests on, and what the mode must see."""
    done = subprocess.run([sys.executable, "tools/bench_busy_core.py", "--bits", "--steps", "2", "--seq", "256",
                           "--batch", "8"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"1 thread against (\d+): (\d+) of (\d+) trainable tensors differ", done.stdout)
    assert found and int(found.group(1)) == usable_cores(), done.stdout
    assert 0 < int(found.group(2)) <= int(found.group(3))
