"""tools/bench_personaliser.py --quick runs end to end and prints its four sections with their ratios."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parent.parent


@pytest.mark.slow
def test_the_quick_run_prints_every_section_and_writes_its_json(tmp_path):
    done = subprocess.run([sys.executable, "tools/bench_personaliser.py", "--quick", "--json", str(tmp_path / "b.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=900, env={"OMP_NUM_THREADS": "1",
                                                                                     "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "personaliser" in out and "(1.00x)" in out and "Store.add_many" in out
    assert "pause latency over 3 pauses" in out and "held-out perplexity" in out
    record = json.loads((tmp_path / "b.json").read_text())
    assert record["ratios"]["personaliser"]["seconds"] > 0
    stream = record["context"]["stream"]
    assert stream["promoted"] + stream["rejected"] == len(stream["windows"]) == 2
    assert stream["after"] < stream["before"]
