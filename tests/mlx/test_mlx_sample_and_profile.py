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


def _train_cli(tmp_path: Path, steps: int, checkpoint_dir: Path, adapter: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "edgetrain.cli", "train", "--backend", "mlx", "--method", "mesp",
                             "--seq", "32", "--batch", "2", "--steps", str(steps), "--checkpoint-every", "2",
                             "--checkpoint-dir", str(checkpoint_dir), "--save-adapter", str(adapter), "--quiet"],
                            capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["steps_done"] == steps


def test_train_cli_on_mlx_resumes_exactly_and_writes_an_mlx_lm_adapter(tmp_path):
    """`edgetrain train --backend mlx`: the MLX LoRA functions, not torch's, attach and save the adapter;
    a run stopped after 2 steps and started again equals an uninterrupted 4-step run."""
    from edgetrain.backends.mlx.adapters import read_mlx_lm_adapters

    _train_cli(tmp_path, 4, tmp_path / "straight", tmp_path / "straight-adapter")
    _train_cli(tmp_path, 2, tmp_path / "resumed", tmp_path / "resumed-adapter")
    _train_cli(tmp_path, 4, tmp_path / "resumed", tmp_path / "resumed-adapter")
    _, _, straight = read_mlx_lm_adapters(tmp_path / "straight-adapter")
    _, _, resumed = read_mlx_lm_adapters(tmp_path / "resumed-adapter")
    assert set(straight) == set(resumed) and straight
    for key, array in straight.items():
        assert (array == resumed[key]).all(), key
    assert any((array != 0).any() for key, array in straight.items() if "lora_b" in key)  # B starts at 0: it trained


def test_train_cli_on_mlx_writes_edgetraings_one_file_to_a_safetensors_path(tmp_path):
    """The README's `--save-adapter adapter.safetensors` on MLX: edgetrain's one-file adapter (which torch and
    MLX load), not a directory of that name."""
    from edgetrain.adapters.convert import detect_format

    _train_cli(tmp_path, 2, tmp_path / "ckpt", tmp_path / "adapter.safetensors")
    assert (tmp_path / "adapter.safetensors").is_file()
    assert detect_format(tmp_path / "adapter.safetensors") == "edgetrain"
    (tmp_path / "held-out.txt").write_text("The with statement wraps a block in a context manager. " * 20)
    result = subprocess.run([sys.executable, "-m", "edgetrain.cli", "eval", "--backend", "mlx", "--adapter",
                             str(tmp_path / "adapter.safetensors"), "--data", "held-out.txt", "--seq", "32",
                             "--batch", "2", "--max-batches", "1"], capture_output=True, text=True, timeout=180,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
