"""Learner(accumulate=N, max_grad_norm=x) on MLX: the same learner code as torch's, through the MLX engine."""
from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install edgetrain[mlx])")

import edgetrain  # noqa: E402
from edgetrain.backends.mlx.loading import load_mlx_model  # noqa: E402
from edgetrain.backends.mlx.lora import add_lora, trainable_parameters  # noqa: E402
from edgetrain.data.batch import Batch  # noqa: E402
from edgetrain.data.text import TextStream  # noqa: E402
from edgetrain.registry import EdgetrainError  # noqa: E402


def _model():
    model = load_mlx_model("tiny", seed=0)
    add_lora(model, rank=4)
    return model


def _batch() -> Batch:
    batch = TextStream(seq_len=24, batch_size=4).batch(0)
    targets = batch.targets.clone()
    targets[0, 5:] = -100
    return Batch(batch.inputs, targets, index=0)


@pytest.mark.parametrize("method", ["bp", "mesp"])
def test_accumulated_micro_batches_make_the_whole_batchs_update_on_mlx(method):
    batch = _batch()
    start = {name: np.array(p) for name, p in trainable_parameters(_model()).items()}
    whole = edgetrain.Learner(_model(), method=method, backend="mlx", optimizer="sgd", lr=0.5)
    parts = edgetrain.Learner(_model(), method=method, backend="mlx", optimizer="sgd", lr=0.5, accumulate=2)
    for _ in range(2):  # the second moves lora_a too (lora_b starts at zero)
        assert parts.step(batch).loss == pytest.approx(whole.step(batch).loss, rel=1e-5)
    for name, weight in trainable_parameters(whole.model).items():
        moved = np.abs(np.array(weight) - start[name]).max()
        difference = np.abs(np.array(trainable_parameters(parts.model)[name]) - np.array(weight)).max()
        assert moved > 0 and difference <= 1e-3 * moved, name


def test_max_grad_norm_clips_the_mlx_update():
    batch = _batch()
    _, grads = edgetrain.Learner(_model(), method="bp", backend="mlx").compute_gradients(batch)
    norm = float(np.sqrt(sum((np.array(g, dtype=np.float64) ** 2).sum() for g in grads.values())))
    learner = edgetrain.Learner(_model(), method="bp", backend="mlx", optimizer="sgd", lr=1.0, max_grad_norm=norm / 4)
    before = {name: np.array(p) for name, p in learner.params.items()}
    learner.step(batch)
    update = [before[name] - np.array(p) for name, p in learner.params.items()]
    assert learner.last_grad_norm == pytest.approx(norm, rel=1e-4)
    assert float(np.sqrt(sum((u.astype(np.float64) ** 2).sum() for u in update))) == pytest.approx(norm / 4, rel=1e-4)


def test_an_mlx_method_that_steps_its_own_way_refuses_accumulation():
    with pytest.raises(EdgetrainError, match="method 'mezo' steps in its own way"):
        edgetrain.Learner(_model(), method="mezo", backend="mlx", accumulate=2)
