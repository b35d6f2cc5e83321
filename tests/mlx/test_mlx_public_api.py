"""The MLX backend through edgetrain's public API: the "mlx" backend is registered by `import
edgetrain` without importing mlx, edgetrain.Learner(model, backend="mlx") runs the one Learner over the MLX engine,
edgetrain.load_model(..., backend="mlx") gives the MLX decoder, `edgetrain profile --backend mlx`
profiles MLX methods (4-bit base too)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

import edgetrain
from edgetrain.registry import EdgetrainError

requires_mlx = pytest.mark.skipif(importlib.util.find_spec("mlx") is None,
                                  reason="mlx is not installed (pip install edgetrain[mlx])")


def test_import_edgetrain_registers_mlx_without_importing_it():
    code = ("import sys, edgetrain; from edgetrain.backends import BACKENDS; "
            "b = BACKENDS.get('mlx'); assert b.framework == 'mlx' and b.device in ('cpu', 'gpu'), b; "
            "assert not any(m == 'mlx' or m.startswith('mlx.') for m in sys.modules), "
            "sorted(m for m in sys.modules if m.startswith('mlx'))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_without_mlx_the_backend_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlx", None)  # `import mlx...` raises ImportError
    monkeypatch.setitem(sys.modules, "mlx.core", None)
    with pytest.raises(EdgetrainError, match="mlx is not importable"):
        edgetrain.load_model("tiny", backend="mlx")
    with pytest.raises(EdgetrainError, match="mlx is not importable"):
        edgetrain.Learner(object(), backend="mlx", method="mesp")


@requires_mlx
def test_load_model_and_learner_dispatch_to_mlx():
    import mlx.core as mx

    from edgetrain.backends.mlx.lora import add_lora
    from edgetrain.backends.mlx.model import MLXDecoder
    from edgetrain.data.text import TextStream

    model = edgetrain.load_model("tiny", backend="mlx")
    assert isinstance(model, MLXDecoder) and model.embed.embed_tokens.weight.dtype == mx.float32
    add_lora(model, rank=4)
    learner = edgetrain.Learner(model, backend="mlx", method="mesp", optimizer="adamw", lr=1e-2,
                                method_options={"fused_update": True})
    assert type(learner) is edgetrain.Learner and learner.engine.framework == "mlx"
    stream = TextStream(seq_len=32, batch_size=2)
    history = learner.fit(stream, max_steps=3, progress=False)
    assert [s.step for s in history] == [1, 2, 3] and all(np.isfinite(s.loss) for s in history)
    assert history[0].probe == "mlx" and history[0].peak_bytes > 0
    # Positional arguments name the backend too (model, method, backend).
    assert edgetrain.Learner(model, "bp", "mlx").engine.framework == "mlx"
    # A torch backend runs the same Learner over the torch engine.
    assert edgetrain.Learner(edgetrain.load_model("tiny"), method="bp").engine.framework == "torch"
    with pytest.raises(EdgetrainError, match="unknown MLX model"):
        edgetrain.load_model("resnet18", backend="mlx")
    assert edgetrain.load_model("tiny", backend="mlx", dtype="bfloat16").embed.embed_tokens.weight.dtype \
        == mx.bfloat16


@requires_mlx
def test_profile_cli_with_the_mlx_backend(tmp_path):
    out = tmp_path / "records.json"
    command = [sys.executable, "-m", "edgetrain.cli", "profile", "--backend", "mlx", "--model", "tiny",
               "--methods", "mebp,mesp", "--seq", "32", "--steps", "1", "--layers", "2", "--quantize-bits", "4",
               "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mlx, base kept as stored, dense matrices in 4 bits, BLAS: " in result.stdout
    records = json.loads(out.read_text())
    assert [r["method"] for r in records] == ["mebp", "mesp"]
    for record in records:
        assert record["backend"] == "mlx" and record["quantize_bits"] == 4 and record["layers"] == 2
        assert record["probe"] == "mlx" and record["peak_bytes_probe"] > 0
        assert record["grad_max_rel_err"] <= 1e-5


def test_profile_cli_refuses_opposite_base_flags():
    """--quantized (the old switch, now the default) and --dequantize contradict each other on every backend."""
    from edgetrain.cli import main

    for backend in ("mlx", "torch-cpu"):
        assert main(["profile", "--backend", backend, "--quantized", "--dequantize", "--steps", "1"]) == 2


@requires_mlx
def test_load_model_quantises_an_mlx_decoders_base_on_load():
    """load_model(..., backend="mlx", quantize_bits=4): the block projections are MLX QuantizedLinears (the
    MeSP paper's 4-bit base) and mesp trains them; bits MLX cannot pack are refused by name."""
    import mlx.nn as mnn

    from edgetrain.data import text_stream

    model = edgetrain.load_model("tiny", backend="mlx", quantize_bits=4)
    assert all(isinstance(block.mlp.down_proj, mnn.QuantizedLinear) for block in model.blocks)
    edgetrain.add_lora(model, rank=4)
    learner = edgetrain.Learner(model, backend="mlx", method="mesp", optimizer="adamw", lr=1e-2)
    losses = [learner.step(batch).loss for _, batch in zip(range(6), text_stream(seq_len=32, batch_size=2))]
    assert losses[-1] < losses[0]
    with pytest.raises(edgetrain.EdgetrainError, match="bits must be one of 2, 3, 4, 6, 8"):
        edgetrain.load_model("tiny", backend="mlx", quantize_bits=5)


@requires_mlx
def test_a_model_of_another_framework_is_refused_by_name():
    mlx_model = edgetrain.load_model("tiny", backend="mlx")
    with pytest.raises(EdgetrainError, match="backend 'torch-cpu' runs torch models; this MLXDecoder is a mlx model"):
        edgetrain.Learner(mlx_model, method="bp")
    with pytest.raises(EdgetrainError, match="backend 'mlx' runs mlx models; this LlamaModel is a torch model"):
        edgetrain.Learner(edgetrain.load_model("tiny"), method="bp", backend="mlx")


@requires_mlx
def test_mlx_learner_is_a_deprecated_name_for_the_learner():
    from edgetrain.backends.mlx.learner import MLXLearner

    model = edgetrain.load_model("tiny", backend="mlx")
    with pytest.warns(DeprecationWarning, match="use edgetrain.Learner"):
        learner = MLXLearner(model, method="bp", optimizer="sgd", lr=1e-3)
    assert type(learner) is edgetrain.Learner and learner.backend.name == "mlx"
