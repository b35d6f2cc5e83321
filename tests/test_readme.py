"""The README's Python quick start and its real-model command-line block run as written."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_quick_start_runs(tmp_path, monkeypatch, capsys):
    text = README.read_text()
    match = re.search(r"<!-- this block is executed by tests/test_readme.py -->\n```python\n(.*?)```", text, re.S)
    assert match, "README lost its executed quick-start block"
    code = match.group(1)
    assert len(code.strip().splitlines()) <= 12
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    loss = float(re.search(r"loss ([\d.]+)", out).group(1))
    assert loss < 5.2  # byte-level text starts near ln(256) = 5.5 on the random-init tiny model
    assert (tmp_path / "adapter.safetensors").is_file()


def test_readme_quick_start_runs_on_mlx_with_the_backend_named(tmp_path, monkeypatch, capsys):
    """The same block with backend="mlx" in load_model and Learner, nothing else changed: add_lora and
    save_lora take the MLX decoder, and the adapter file is edgetrain's."""
    pytest.importorskip("mlx.core", reason="mlx is not installed (pip install edgetrain[mlx])")
    from edgetrain.adapters.convert import detect_format

    text = README.read_text()
    code = re.search(r"<!-- this block is executed by tests/test_readme.py -->\n```python\n(.*?)```", text, re.S).group(1)
    for call in ('edgetrain.load_model("tiny"', "edgetrain.Learner(model, "):
        assert code.count(call) == 1, call
    code = code.replace('edgetrain.load_model("tiny"', 'edgetrain.load_model("tiny", backend="mlx"')
    code = code.replace("edgetrain.Learner(model, ", 'edgetrain.Learner(model, backend="mlx", ')
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    out = capsys.readouterr().out
    assert "(mlx)" in out and float(re.search(r"loss ([\d.]+)", out).group(1)) < 5.2
    assert detect_format(tmp_path / "adapter.safetensors") == "edgetrain"
    # The file holds the trained adapters: loaded into a fresh MLX decoder, the same logits.
    import edgetrain
    import mlx.core as mx
    import numpy as np

    fresh = edgetrain.load_model("tiny", backend="mlx", adapter=tmp_path / "adapter.safetensors")
    tokens = mx.array(np.arange(12, dtype=np.int32)[None])
    np.testing.assert_allclose(np.array(fresh(tokens)), np.array(scope["model"](tokens)), rtol=1e-5, atol=1e-5)
    base = edgetrain.load_model("tiny", backend="mlx")
    assert np.abs(np.array(fresh(tokens)) - np.array(base(tokens))).max() > 1e-3  # the adapters trained


@pytest.mark.slow
def test_readme_real_model_personalisation_runs_and_lowers_held_out_perplexity(tmp_path):
    """The README's command-line block on SmolLM2-135M, as written: 40 MeSP steps lower held-out perplexity
    by at least 20% (the README quotes 27.5 -> 18.0)."""
    import json
    import os
    import subprocess
    import sys

    text = README.read_text()
    match = re.search(r"<!-- this block is executed by tests/test_readme.py \(slow lane[^>]*-->\n```bash\n(.*?)```",
                      text, re.S)
    assert match, "README lost its executed real-model block"
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", match.group(1)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1500)
    if done.returncode != 0 and "could not download" in done.stderr:
        pytest.skip(f"the model cannot be fetched here: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr[-3000:]
    evals = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"loss"')]
    before, after = evals[0]["perplexity"], evals[1]["perplexity"]
    assert after <= 0.8 * before, (before, after)
    lines = done.stdout.splitlines()
    assert lines[-1].strip() == "adapter.gguf"  # export-adapter prints what it wrote
    generated = [line for line in lines[:-1] if line.strip() and not line.startswith('{"loss"')]
    assert generated, "generate wrote nothing"
    from edgetrain.adapters.convert import AdapterBase, read_adapter
    from edgetrain.models.decoder_config import decoder_config

    config, _ = read_adapter(tmp_path / "adapter.gguf", AdapterBase(config=decoder_config("smollm2-135m")))
    assert config.rank == 8


@pytest.mark.slow
def test_readme_real_model_block_runs_on_mlx_with_the_backend_named(tmp_path):
    """The same command-line block with `--backend mlx` on eval, generate and train (export-adapter reads
    files, no backend): every command runs on MLX and the adapter it trains converts to llama.cpp's GGUF.
    What is checked does not depend on the run's size, so it runs small: 2 training steps instead of 40,
    sequences of 32 tokens instead of 128, one evaluation batch, 8 generated tokens. (mlx[cpu]'s Linux wheel
    multiplies matrices with the reference BLAS, about 2 GFLOP/s here: the block as written took 9 minutes.)"""
    pytest.importorskip("mlx.core", reason="mlx is not installed (pip install edgetrain[mlx])")
    import os
    import subprocess
    import sys

    text = README.read_text()
    block = re.search(r"<!-- this block is executed by tests/test_readme.py \(slow lane[^>]*-->\n```bash\n(.*?)```",
                      text, re.S).group(1)
    for command in ("eval", "generate", "train"):
        assert block.count(f"edgetrain {command} ") >= 1, command
        block = block.replace(f"edgetrain {command} ", f"edgetrain {command} --backend mlx ")
    for full, small in (("--steps 40", "--steps 2"), ("--seq 128", "--seq 32"), ("--max-batches 4", "--max-batches 1"),
                        ("--max-tokens 40", "--max-tokens 8")):
        assert full in block, full
        block = block.replace(full, small)
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1500)
    if done.returncode != 0 and "could not download" in done.stderr:
        pytest.skip(f"the model cannot be fetched here: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1].strip() == "adapter.gguf"
    assert (tmp_path / "adapter.safetensors").is_file()
    evals = [line for line in done.stdout.splitlines() if line.startswith('{"loss"')]
    assert len(evals) == 2
