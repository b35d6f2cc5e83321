"""tools/bench_quantized.py --quick: every arm runs and the 4-bit base holds less than the fp32 one."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parent.parent


@pytest.mark.slow
def test_the_quick_run_compares_fp32_and_4_bit_bases(tmp_path):
    done = subprocess.run([sys.executable, "tools/bench_quantized.py", "--quick", "--json", str(tmp_path / "q.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mesp 4-bit base / mebp fp32 base" in done.stdout
    records = json.loads((tmp_path / "q.json").read_text())
    dense, packed = records["mesp, fp32 base"], records["mesp, 4-bit base"]
    assert packed["quantize_bits"] == 4 and packed["weights_bytes"] < 0.5 * dense["weights_bytes"]
    assert packed["footprint_bytes"] < dense["footprint_bytes"]
