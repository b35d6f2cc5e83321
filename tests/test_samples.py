"""The samples users copy from: they run, and they do what they say."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_personalise_tiny_mebp_lowers_held_out_perplexity_and_writes_the_adapter(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "samples" / "personalise_tiny_mebp.py"), "--steps", "20",
                             "--adapter", str(tmp_path / "adapter.safetensors")],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    before = float(re.search(r"perplexity before: ([\d.]+)", result.stdout).group(1))
    after = float(re.search(r"perplexity after 20 steps: ([\d.]+)", result.stdout).group(1))
    assert after < 0.7 * before
    import edgetrain

    model = edgetrain.load_model("tiny")
    edgetrain.add_lora(model, rank=8)
    edgetrain.load_lora(model, tmp_path / "adapter.safetensors")
