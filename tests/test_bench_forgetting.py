"""tools/bench_forgetting.py --quick runs its three arms end to end on the tiny preset and prints its table."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parent.parent


@pytest.mark.slow
def test_the_quick_run_prints_the_three_arms_and_writes_its_json(tmp_path):
    done = subprocess.run([sys.executable, "tools/bench_forgetting.py", "--quick", "--json", str(tmp_path / "f.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=900, env={"OMP_NUM_THREADS": "1",
                                                                                     "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for arm in ("| no guard |", "| guard |", "| guard+replay |"):
        assert arm in out
    assert "making the retain set:" in out and "base model: user" in out
    record = json.loads((tmp_path / "f.json").read_text())
    assert set(record["arms"]) == {"no guard", "guard", "guard+replay"}
    for rows in record["arms"].values():
        assert len(rows) == 2 and all(row["user"] > 0 and row["general"] > 0 and row["retain"] > 0 for row in rows)
    assert record["arms"]["guard"][0]["retain_built_seconds"] > 0
