"""The Mac sample runs (--quick), and profile_method_mlx gives the profiler's record fields."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install edgetrain[mlx])")

from edgetrain.backends.mlx.profile import blas_in_use, profile_method_mlx  # noqa: E402
from edgetrain.profiler.config import RECORD_FIELDS, ProfileConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def test_mac_sample_quick_trains_and_writes_an_mlx_lm_adapter(tmp_path):
    corpus = tmp_path / "notes"
    corpus.mkdir()
    from pydoc_data.topics import topics

    (corpus / "a.txt").write_text(topics["assignment"] + topics["if"])
    result = subprocess.run([sys.executable, str(REPO / "samples" / "mac_mlx_mesp.py"), str(corpus), "--quick",
                             "--out", str(tmp_path / "adapter")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    steps = [line for line in result.stdout.splitlines() if line.startswith("step")]
    assert len(steps) == 4 and all("peak" in line and "MiB" in line for line in steps)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "lora" and (tmp_path / "adapter" / "adapters.safetensors").is_file()


@pytest.mark.parametrize("method", ["mesp", "mezo"])
def test_profile_record_has_the_profilers_fields(method):
    config = ProfileConfig(model="tiny", method=method, backend="mlx", seq=32, steps=1, layers=2)
    record = profile_method_mlx(config, quantize_bits=4)
    assert set(RECORD_FIELDS) <= set(record)
    assert record["backend"] == "mlx" and record["layers"] == 2 and record["quantize_bits"] == 4
    assert record["peak_bytes_probe"] > 0 and record["peak_bytes_tensors"] == record["peak_bytes_probe"]
    assert record["blas"] == blas_in_use()
    if method == "mesp":
        assert record["grad_max_rel_err"] < 1e-5 and record["grad_cosine"] > 0.999999
