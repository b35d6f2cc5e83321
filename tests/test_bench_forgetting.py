"""tools/bench_forgetting.py --quick runs its four arms end to end on the tiny preset and prints its table; the
defaults arm (no option given) is the guard+replay 0.25 arm."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parent.parent


@pytest.mark.slow
def test_the_quick_run_prints_the_four_arms_and_writes_its_json(tmp_path):
    done = subprocess.run([sys.executable, "tools/bench_forgetting.py", "--quick", "--json", str(tmp_path / "f.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=900, env={"OMP_NUM_THREADS": "1",
                                                                                     "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for arm in ("| defaults |", "| no guard |", "| guard |", "| guard+replay |"):
        assert arm in out
    assert "making the retain set:" in out and "base model: user" in out
    record = json.loads((tmp_path / "f.json").read_text())
    assert set(record["arms"]) == {"defaults", "no guard", "guard", "guard+replay"}
    for rows in record["arms"].values():
        assert len(rows) == 2 and all(row["user"] > 0 and row["general"] > 0 and row["retain"] > 0 for row in rows)
    assert record["arms"]["defaults"][0]["retain_built_seconds"] > 0
    # With no option a decoder store replays a quarter of its batches: the same windows as replay=0.25.
    for default, replayed in zip(record["arms"]["defaults"], record["arms"]["guard+replay"]):
        assert default["gate"] == replayed["gate"]
        for figure in ("user", "general", "retain"):
            assert default[figure] == pytest.approx(replayed[figure], rel=1e-4)
