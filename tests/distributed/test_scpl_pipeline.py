"""Pipelined SCPL (one torchrun worker per component, gloo on CPU, OMP_NUM_THREADS=1 in the workers)
against the single-process `scpl` method: same weights after N steps, and the same local loss on
every worker at every step. Each run is bounded by a timeout."""
from __future__ import annotations

import pytest
import torch

import edgetrain
from edgetrain.training.checkpoint import load_safetensors_checked
from edgetrain.data import make_stream
from edgetrain.recipes.scpl_pipeline import PipelineConfig, launch
from edgetrain.models import load_model

STEPS = 6
BATCH = 16
OPTIONS = {"projection_dims": [32, 32], "augment": {"flip": 0.0, "crop_scale": [0.7, 1.0]}}


# One intra-op thread (tests/conftest.py: fixed reduction order, no OpenMP spinning).
pytestmark = pytest.mark.usefixtures("one_thread")


def sequential(num_components: int):
    learner = edgetrain.Learner(load_model("convnet-digits"), method="scpl", optimizer="adam", lr=1e-3, probe=False,
                                method_options=dict(OPTIONS, num_components=num_components))
    losses = []
    for _, batch in zip(range(STEPS), make_stream("digits", batch_size=BATCH)):
        learner.step(batch)
        losses.append(learner.method.last_losses)
    return learner.model.state_dict(), losses


def pipelined(tmp_path, workers: int, micro_batches: int):
    path = tmp_path / f"pipeline-{workers}.safetensors"
    config = PipelineConfig(model="convnet-digits", method="scpl", method_options=OPTIONS, data="digits",
                            batch_size=BATCH, steps=STEPS, optimizer="adam", lr=1e-3, micro_batches=micro_batches,
                            threads=1, device="cpu", save=str(path))
    report = launch(config, workers, timeout=300)
    weights, _ = load_safetensors_checked(path)
    return weights, report


def test_two_workers_match_the_sequential_mode(tmp_path):
    weights, report = pipelined(tmp_path, workers=2, micro_batches=1)
    assert report["backend"] == "gloo" and report["world_size"] == 2
    assert report["split"] == "embed+blocks.0+blocks.1 | blocks.2+head"
    expected, losses = sequential(num_components=2)
    assert set(weights) == set(expected)  # model weights, buffers and the projection heads, all workers
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    for worker in report["workers"]:
        assert worker["losses"] == pytest.approx([step[worker["rank"]] for step in losses], rel=1e-5)


def test_three_workers_with_micro_batches_match(tmp_path):
    """The SCPL + GPipe hybrid (A.5): forwards in 2 micro-batches, the loss and backward over the whole
    batch -- the same gradient up to summation order for a model without BatchNorm."""
    weights, report = pipelined(tmp_path, workers=3, micro_batches=2)
    assert report["split"] == "embed+blocks.0 | blocks.1 | blocks.2+head"
    expected, losses = sequential(num_components=3)
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    for worker in report["workers"]:
        assert worker["losses"] == pytest.approx([step[worker["rank"]] for step in losses], rel=1e-4)
