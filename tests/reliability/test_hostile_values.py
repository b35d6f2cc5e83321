"""Fault classes 2 and 5 drawn at random: hostile learning rates and method options (class 2), and hostile
batches (class 5), fed to a real learner. Each draw is refused by name, with the weights and optimizer
state untouched, or accepted; an accepted draw must be one the oracle below calls valid, and its step
must leave finite weights. (test_non_finite.py and tests/data/test_validate_batch.py hold the cases
written by hand.)"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import edgetrain
from edgetrain.data.batch import Batch
from fault_tally import attempt, fuzz_settings

FUZZ = fuzz_settings(40)
VOCAB = 256

HOSTILE_NUMBERS = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -1e-3, 1e39, 1e308, 5e-324, 1e-3, 0.1, 2]),
    st.sampled_from(["0.1", "nan", None, True, False, [], {}, b"1"]),
    st.floats(allow_nan=True, allow_infinity=True))


def _model():
    torch.manual_seed(0)
    return edgetrain.add_lora(edgetrain.load_model("tiny"), rank=2)


def _weights(learner):
    return {name: p.detach().clone() for name, p in learner.params.items()}


def _batch(seed: int = 0, index: int = 0) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, 9), generator=generator)
    return Batch(tokens[:, :-1].clone(), tokens[:, 1:].clone(), index)


def _usable_rate(value) -> bool:
    """The learner's contract: a finite number in [0, 1e6]; 0 is a frozen run, a legitimate diagnostic."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and 0 <= value <= 1e6)


@FUZZ
@given(method=st.sampled_from(["bp", "mebp", "mesp", "mezo", "fgd"]), lr=HOSTILE_NUMBERS,
       option=st.sampled_from([None, "epsilon", "alpha", "num_tangents", "seed"]), value=HOSTILE_NUMBERS)
def test_hostile_learning_rates_and_options_are_refused_or_train_to_finite_weights(method, lr, option, value):
    options = {} if option is None else {option: value}
    if option == "epsilon" and method != "mezo" or option in ("alpha", "num_tangents") and method != "fgd":
        options = {}

    def build_and_step():
        learner = edgetrain.Learner(_model(), method=method, optimizer="sgd", lr=lr, probe=False,
                                    method_options=options)
        before = _weights(learner)
        try:
            learner.step(_batch())
        except edgetrain.EdgetrainError:
            # A refused step (e.g. an update too large for the weights) changes nothing.
            assert all(torch.equal(p, before[n]) for n, p in learner.params.items())
            raise
        return learner, before

    def sound(result) -> bool:
        # Accepted only with a usable rate, and the step left finite weights; a rate of 0 leaves them alone.
        learner, before = result
        frozen = lr != 0 or all(torch.equal(p, before[n]) for n, p in learner.params.items())
        return (_usable_rate(lr) and frozen
                and all(bool(torch.isfinite(p).all()) for p in learner.params.values()))

    attempt("non-finite numbers", build_and_step, sound=sound)


_DTYPES = [torch.long, torch.int32, torch.int16, torch.uint8, torch.bool, torch.float32, torch.float64]


def _holds(dtype: torch.dtype, value: int) -> bool:
    if dtype == torch.bool:
        return False
    if dtype.is_floating_point:
        return True
    info = torch.iinfo(dtype)
    return info.min <= value <= info.max


@st.composite
def hostile_batches(draw):
    batch_size, length = draw(st.integers(0, 3)), draw(st.integers(0, 6))
    shape = draw(st.sampled_from(["[B,T]", "[B,T,1]", "[T]", "[B,T+1] targets", "[B] targets"]))
    inputs = torch.randint(0, VOCAB, (batch_size, length))
    targets = torch.randint(0, VOCAB, (batch_size, length))
    if draw(st.booleans()):
        inputs = inputs.to(draw(st.sampled_from(_DTYPES)))
    if draw(st.booleans()):
        targets = targets.to(draw(st.sampled_from(_DTYPES)))
    if shape == "[B,T,1]":
        inputs = inputs[..., None]
    elif shape == "[T]":
        inputs, targets = inputs.reshape(-1), targets.reshape(-1)
    elif shape == "[B,T+1] targets":
        targets = torch.cat([targets, targets[:, :1]], dim=1)
    elif shape == "[B] targets":
        targets = targets[:, 0] if length else targets.new_zeros(batch_size)
    value = draw(st.sampled_from([None, -1, VOCAB, -100, 10 ** 6]))
    tensor = inputs if draw(st.booleans()) else targets
    if value is not None and tensor.numel() and _holds(tensor.dtype, value):
        tensor.view(-1)[0] = value
    if inputs.is_floating_point() and inputs.numel() and draw(st.booleans()):
        inputs.view(-1)[0] = float("nan")
    index = draw(st.sampled_from([0, 5, -5, None, "7", 3.5, True]))
    return Batch(inputs, targets, index)


def _valid_lm_batch(batch: Batch) -> bool:
    """The oracle: what a decoder's step may accept."""
    inputs, targets, index = batch.inputs, batch.targets, batch.index
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        return False
    if inputs.dtype != torch.long or targets.dtype != torch.long or inputs.dim() != 2 or inputs.numel() == 0:
        return False
    if targets.shape != inputs.shape or int(inputs.min()) < 0 or int(inputs.max()) >= VOCAB:
        return False
    kept = targets[targets != -100]
    return kept.numel() > 0 and int(kept.min()) >= 0 and int(kept.max()) < VOCAB


@pytest.mark.parametrize("method", ["mebp", "mesp", "mezo"])
@fuzz_settings(25)
@given(batch=hostile_batches())
def test_hostile_batches_are_refused_before_any_weight_changes(method, batch):
    learner = edgetrain.Learner(_model(), method=method, optimizer="adamw", lr=1e-3, probe=False)
    learner.step(_batch(seed=1))  # optimizer state exists: a bad batch must not touch it either
    before = _weights(learner)
    moments = [s["exp_avg"].clone() for s in learner.optimizer.state.values()]

    def sound(stats) -> bool:
        return _valid_lm_batch(batch) and all(bool(torch.isfinite(p).all()) for p in learner.params.values())

    outcome = attempt("batches", lambda: learner.step(batch), sound=sound)
    if isinstance(outcome, edgetrain.EdgetrainError):
        assert all(torch.equal(p, before[n]) for n, p in learner.params.items())
        assert all(torch.equal(s["exp_avg"], m) for s, m in zip(learner.optimizer.state.values(), moments))
        assert learner.steps_done == 1


@pytest.mark.parametrize("method", ["bp", "mebp", "mesp", "mezo", "fgd"])
def test_a_rate_of_zero_is_accepted_and_leaves_every_methods_weights_alone(method):
    learner = edgetrain.Learner(_model(), method=method, optimizer="sgd", lr=0.0, probe=False)
    before = _weights(learner)
    learner.step(_batch())
    assert learner.steps_done == 1
    assert all(torch.equal(p, before[n]) for n, p in learner.params.items())
