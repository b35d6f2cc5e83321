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


@pytest.mark.skipif(usable_cores() < 2, reason="the benchmark keeps one of at least 2 cores busy")
def test_one_round_runs_every_arm_and_leaves_no_spinner():
    done = subprocess.run([sys.executable, "tools/bench_busy_core.py", "--steps", "3", "--repeats", "1"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line[:34].strip(): line[34:].split() for line in done.stdout.splitlines() if line.startswith(("quiet", "busy"))}
    assert len(rows) == 5, done.stdout
    auto = rows["busy core, threads=auto"]
    assert float(auto[1]) < usable_cores()  # the thread count it ran on, averaged over its steps
    assert re.search(r"busy core, personaliser \(auto\)\s+[\d.]+\s+auto", done.stdout)
    spinners = [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [])[-1:] == ["while True: pass"]]
    assert spinners == []
