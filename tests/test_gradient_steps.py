"""Learner(accumulate=N, max_grad_norm=x): micro-batch gradients summed into the whole batch's gradient,
one update, clipped to a global norm; refusals by name, and a failed accumulated step changes nothing."""
from __future__ import annotations

import copy

import pytest
import torch

import edgetrain
from edgetrain.data.batch import Batch
from edgetrain.methods.base import TrainingError
from edgetrain.registry import EdgetrainError


def _padded_batch(text_batches) -> Batch:
    """Four samples whose valid targets differ in number: an unweighted mean of micro-batch gradients
    would not be the batch's gradient."""
    batch = text_batches(1, seq_len=24, batch_size=4)[0]
    targets = batch.targets.clone()
    targets[0, 5:] = -100
    targets[3, 20:] = -100
    return Batch(batch.inputs, targets, index=0)


def _weights(learner) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in learner.params.items()}


@pytest.mark.parametrize("method", ["bp", "mebp", "mesp"])
@pytest.mark.parametrize("accumulate", [2, 3])
def test_accumulated_micro_batches_make_the_whole_batchs_update(method, accumulate, tiny_lora, text_batches):
    batch = _padded_batch(text_batches)
    model = tiny_lora(rank=4).double()  # float64: the two sums differ only in rounding, far below the update
    # SGD: the update is the gradient itself (Adam would magnify rounding in near-zero gradients).
    whole = edgetrain.Learner(copy.deepcopy(model), method=method, optimizer="sgd", lr=0.5)
    parts = edgetrain.Learner(copy.deepcopy(model), method=method, optimizer="sgd", lr=0.5, accumulate=accumulate)
    for _ in range(2):
        whole_loss, parts_loss = whole.step(batch).loss, parts.step(batch).loss
        assert parts_loss == pytest.approx(whole_loss, rel=1e-6)
    start = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    for name, weight in _weights(whole).items():
        moved = (weight - start[name]).abs().max()
        assert moved > 0 and (_weights(parts)[name] - weight).abs().max() <= 1e-9 * moved


def test_max_grad_norm_scales_the_update_to_that_norm_and_leaves_a_smaller_one(tiny_lora, text_batches):
    batch = text_batches(1, seq_len=24, batch_size=2)[0]
    model = tiny_lora(rank=4)
    _, grads = edgetrain.Learner(copy.deepcopy(model), method="bp").compute_gradients(batch)
    norm = float(torch.sqrt(sum(g.double().square().sum() for g in grads.values())))
    for max_norm, expected_norm in [(norm / 4, norm / 4), (norm * 2, norm)]:
        learner = edgetrain.Learner(copy.deepcopy(model), method="bp", optimizer="sgd", lr=1.0,
                                    max_grad_norm=max_norm)
        before = _weights(learner)
        learner.step(batch)
        update = {name: before[name] - p for name, p in _weights(learner).items()}
        assert learner.last_grad_norm == pytest.approx(norm, rel=1e-6)
        assert float(torch.sqrt(sum(u.double().square().sum() for u in update.values()))) == \
            pytest.approx(expected_norm, rel=1e-5)
        for name, g in grads.items():  # the direction is the gradient's
            torch.testing.assert_close(update[name], g * (expected_norm / norm), rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("options, message", [
    (dict(accumulate=0), "accumulate must be"), (dict(accumulate=1.5), "accumulate must be"),
    (dict(accumulate=True), "accumulate must be"), (dict(max_grad_norm=float("nan")), "max_grad_norm must be"),
    (dict(max_grad_norm=-1.0), "max_grad_norm must be"), (dict(max_grad_norm="1"), "max_grad_norm must be"),
])
def test_bad_accumulation_settings_are_named_errors(options, message, tiny_lora):
    with pytest.raises(EdgetrainError, match=message):
        edgetrain.Learner(tiny_lora(), method="bp", **options)


@pytest.mark.parametrize("method", ["mezo", "segprop"])
def test_a_method_that_steps_its_own_way_refuses_accumulation_by_name(method, tiny_lora):
    with pytest.raises(EdgetrainError, match=f"method {method!r} steps in its own way"):
        edgetrain.Learner(tiny_lora(), method=method, accumulate=2)


def test_more_micro_batches_than_samples_is_refused_with_nothing_changed(tiny_lora, text_batches):
    learner = edgetrain.Learner(tiny_lora(), method="bp", optimizer="adam", lr=1e-2, accumulate=3)
    before = _weights(learner)
    with pytest.raises(EdgetrainError, match="accumulate=3 cuts each batch into 3 micro-batches.*has 2"):
        learner.step(text_batches(1, seq_len=16, batch_size=2)[0])
    assert learner.steps_done == 0 and learner.optimizer.state_dict()["state"] == {}
    assert all(torch.equal(p, before[name]) for name, p in _weights(learner).items())


def test_a_non_finite_micro_batch_gradient_leaves_the_last_good_step(tiny_lora, text_batches, monkeypatch):
    batches = text_batches(2, seq_len=16, batch_size=4)
    learner = edgetrain.Learner(tiny_lora(), method="mesp", optimizer="adam", lr=1e-2, accumulate=2,
                                max_grad_norm=1.0)
    learner.step(batches[0])
    weights, state = _weights(learner), copy.deepcopy(learner.optimizer.state_dict())
    original = learner.method.gradients
    calls = []

    def poisoned(batch):
        loss, grads = original(batch)
        calls.append(1)
        if len(calls) == 2:  # the second micro-batch
            name = next(iter(grads))
            grads[name] = grads[name].clone().fill_(float("nan"))
        return loss, grads

    monkeypatch.setattr(learner.method, "gradients", poisoned)
    with pytest.raises(TrainingError, match="step 2 stopped on batch 1"):
        learner.step(batches[1])
    assert learner.steps_done == 1
    for name, p in _weights(learner).items():
        assert torch.equal(p, weights[name])
    after = learner.optimizer.state_dict()["state"]
    assert all(torch.equal(after[k]["exp_avg"], state["state"][k]["exp_avg"]) for k in after)
