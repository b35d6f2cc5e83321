"""Learning-rate schedules: the documented rates at each step, and bad settings refused by name."""
from __future__ import annotations

import math

import pytest

import edgetrain
from edgetrain.training.schedules import LRSchedule, ScheduleError, check_learning_rate


def _rates(name: str, steps: int, **options) -> list[float]:
    schedule = LRSchedule.make(name, options)
    return [schedule.rate(1.0, step) for step in range(steps)]


def test_constant_is_the_base_rate_at_every_step():
    assert _rates("constant", 5) == [1.0] * 5


def test_warmup_ramps_linearly_then_holds():
    assert _rates("linear-warmup", 6, warmup_steps=3) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_linear_decays_from_the_end_of_warmup_to_the_floor_and_stays():
    rates = _rates("linear", 9, warmup_steps=1, total_steps=5, min_lr_ratio=0.2)
    assert rates == pytest.approx([0.5, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2, 0.2, 0.2])


def test_cosine_follows_half_a_cosine_to_the_floor():
    rates = _rates("cosine", 7, warmup_steps=0, total_steps=4, min_lr_ratio=0.0)
    expected = [0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(5)] + [0.0, 0.0]
    assert rates == pytest.approx(expected, abs=1e-15)
    floor = _rates("cosine", 6, total_steps=4, min_lr_ratio=0.1)
    assert floor[0] == 1.0 and floor[4:] == pytest.approx([0.1, 0.1])


def test_round_trip_through_a_checkpoint_dict():
    schedule = LRSchedule.make("cosine", {"warmup_steps": 2, "total_steps": 10, "min_lr_ratio": 0.05})
    assert LRSchedule.from_dict(schedule.to_dict()) == schedule


@pytest.mark.parametrize("name,options,message", [
    ("cosinus", {}, "unknown lr schedule 'cosinus'"),
    ("cosine", {"warmup": 3}, "unknown option"),
    ("cosine", {"total_steps": 0}, "total_steps"),
    ("linear", {"warmup_steps": 5, "total_steps": 5}, "above warmup_steps"),
    ("constant", {"warmup_steps": -1}, "non-negative integer"),
    ("constant", {"warmup_steps": 2.5}, "non-negative integer"),
    ("constant", {"min_lr_ratio": float("nan")}, r"min_lr_ratio must be in \[0, 1\]"),
    ("constant", {"min_lr_ratio": 1.5}, r"min_lr_ratio must be in \[0, 1\]"),
])
def test_bad_schedule_settings_are_refused_by_name(name, options, message):
    with pytest.raises(edgetrain.EdgetrainError, match=message):
        LRSchedule.make(name, options)


@pytest.mark.parametrize("lr", [float("nan"), float("inf"), -1e-3, 1e39, "0.1", True, None])
def test_a_learning_rate_that_cannot_train_is_refused(lr):
    with pytest.raises(ScheduleError, match="lr must be"):
        check_learning_rate(lr)


def test_the_learner_refuses_a_nan_learning_rate_before_touching_the_model():
    model = edgetrain.load_model("tiny")
    edgetrain.add_lora(model, rank=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(edgetrain.EdgetrainError, match="lr must be a finite number"):
        edgetrain.Learner(model, method="bp", lr=float("nan"), probe=False)
    assert all(v.equal(before[k]) for k, v in model.state_dict().items())
