"""Learner(model, backend="mlx"): the one Learner over the MLX engine -- steps with StepStats, gradients, evaluation,
atomic checkpoints that resume exactly, fit over a text stream, memory budget, backend registry."""
from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install edgetrain[mlx])")

import edgetrain.backends.mlx  # noqa: E402,F401  (registers the backend)
from edgetrain.backends.base import BACKENDS  # noqa: E402
from edgetrain.backends.mlx.loading import load_mlx_model  # noqa: E402
from edgetrain.backends.mlx.lora import add_lora, trainable_parameters  # noqa: E402
from edgetrain.data.text import TextStream  # noqa: E402
from edgetrain.methods.base import TrainingError  # noqa: E402
from edgetrain.training.learner import (  # noqa: E402
    Learner,  # noqa: E402
    MemoryBudgetError,
    StepStats,
)


def tiny_model(rank: int = 4):
    model = load_mlx_model("tiny", seed=0)
    add_lora(model, rank=rank)
    return model


def stream(seq: int = 32, start_index: int = 0) -> TextStream:
    return TextStream(seq_len=seq, batch_size=2, start_index=start_index)


def test_backend_is_registered_as_mlx():
    backend = BACKENDS.get("mlx")
    assert backend.framework == "mlx" and backend.device in ("cpu", "gpu")
    assert backend.availability() == (True, "")
    backend.synchronize()


@pytest.mark.parametrize("method", ["bp", "mebp", "mezo", "mesp"])
def test_step_reports_stats_with_mlx_memory(method):
    learner = Learner(tiny_model(), backend="mlx", method=method, optimizer="adamw", lr=1e-3)
    stats = learner.step(stream().batch(0))
    assert isinstance(stats, StepStats) and stats.step == 1 and stats.probe == "mlx"
    assert np.isfinite(stats.loss) and stats.tokens == 64 and stats.peak_bytes > 0
    loss, grads = learner.compute_gradients(stream().batch(1))
    assert set(grads) == set(trainable_parameters(learner.model)) and np.isfinite(loss)
    assert np.array(next(iter(grads.values()))).dtype == np.float32


def test_checkpoint_resumes_exactly(tmp_path):
    first = Learner(tiny_model(), backend="mlx", method="mesp", optimizer="adam", lr=1e-2,
                       method_options={"fused_update": True})
    for index in range(3):
        first.step(stream().batch(index))
    path = first.save(tmp_path / "ckpt.safetensors")
    expected = [first.step(stream().batch(index)).loss for index in (3, 4)]

    second = Learner(tiny_model(), backend="mlx", method="mesp", optimizer="adam", lr=1e-2,
                        method_options={"fused_update": True}).load(path)
    assert second.steps_done == 3 and second.stream_position == 3
    resumed = [second.step(stream().batch(index)).loss for index in (3, 4)]
    np.testing.assert_allclose(resumed, expected, rtol=1e-6)
    with pytest.raises(Exception, match="method"):
        Learner(tiny_model(), backend="mlx", method="bp").load(path)


def test_fit_checkpoints_and_resume(tmp_path):
    learner = Learner(tiny_model(), backend="mlx", method="bp", optimizer="adamw", lr=1e-2)
    history = learner.fit(stream(), max_steps=4, checkpoint_every=2, checkpoint_dir=tmp_path,
                          eval_every=4, eval_batches=lambda: [stream().batch(100)], progress=False)
    assert [s.step for s in history] == [1, 2, 3, 4]
    again = Learner(tiny_model(), backend="mlx", method="bp", optimizer="adamw", lr=1e-2)
    assert again.resume(tmp_path).name == "step-00000004.safetensors" and again.steps_done == 4
    metrics = again.evaluate([stream().batch(100)])
    assert metrics["perplexity"] == pytest.approx(np.exp(metrics["loss"]))


def test_non_finite_gradient_keeps_the_last_good_weights():
    learner = Learner(tiny_model(), backend="mlx", method="mesp", optimizer="sgd", lr=1.0,
                         method_options={"fused_update": True})
    learner.step(stream().batch(0))
    good = {n: np.array(p) for n, p in trainable_parameters(learner.model).items()}
    # Poison one adapter in the middle of the model: the loss itself is NaN, so the step is refused
    # before any block is updated. (A NaN found part-way through the fused walk, after later blocks
    # were updated, is tests/mlx/test_mlx_step_formulas.py's rollback test.)
    from edgetrain.backends.mlx.lora import set_parameters

    name = "blocks.1.mlp.up_proj.lora_b"
    set_parameters(learner.model, {name: mx.full(good[name].shape, mx.nan)})
    poisoned = {n: np.array(p) for n, p in trainable_parameters(learner.model).items()}
    with pytest.raises(TrainingError):
        learner.step(stream().batch(1))
    for n, p in trainable_parameters(learner.model).items():
        np.testing.assert_array_equal(np.array(p), poisoned[n])
    assert learner.steps_done == 1


@pytest.mark.parametrize("method, optimizer", [("bp", "adam"), ("mezo", "sgd"), ("mesp", "adamw")])
def test_the_budget_guards_measured_slices_leave_no_trace_when_the_step_fits(method, optimizer):
    def run(memory_budget):
        learner = Learner(tiny_model(), backend="mlx", method=method, optimizer=optimizer, lr=1e-2, memory_budget=memory_budget,
                             lr_schedule="linear-warmup", schedule_options={"warmup_steps": 3})
        losses = [learner.step(stream(seq=64).batch(index)).loss for index in range(3)]
        return learner, losses

    (guarded, guarded_losses), (plain, plain_losses) = run("64GiB"), run(None)
    assert guarded_losses == plain_losses and guarded.steps_done == plain.steps_done == 3
    for name, value in trainable_parameters(guarded.model).items():
        np.testing.assert_array_equal(np.array(value), np.array(trainable_parameters(plain.model)[name]))
    assert guarded.method.state_dict() == plain.method.state_dict()


def test_memory_budget_falls_back_then_refuses():
    learner = Learner(tiny_model(), backend="mlx", method="bp", memory_budget=1, fallback_methods=["mesp"])
    with pytest.raises(MemoryBudgetError, match="bp: .*mesp: "):
        learner.step(stream().batch(0))
    assert learner.steps_done == 0
