"""Threads that fit the cores the device has free (edgetrain.training.threads): the choice from fake load
readings, the learner and the personaliser applying it between steps, the flags."""
from __future__ import annotations

import argparse

import pytest
import torch

import edgetrain
from edgetrain.data.batch import Batch
from edgetrain.training import threads as threads_module
from edgetrain.training.threads import CpuReading, ThreadFitter, fit_threads, others_busy_cores, threads_flag


@pytest.mark.parametrize("cores, others, limit, expected", [
    (2, 0.0, None, 2), (2, 0.4, None, 2), (2, 0.6, None, 1), (2, 1.0, None, 1), (2, 7.5, None, 1),
    (8, 2.7, None, 5), (8, 0.0, 3, 3), (4, 3.9, 2, 1)])
def test_threads_fit_the_cores_others_leave_free(cores, others, limit, expected):
    assert fit_threads(cores, others, limit) == expected


def test_others_busy_time_is_the_systems_less_this_process():
    before = CpuReading(wall=10.0, system_busy=100.0, own=40.0)
    # 2 s of wall time: 3 core-seconds busy in all, 2 of them ours -> others kept half a core busy.
    assert others_busy_cores(before, CpuReading(12.0, 103.0, 42.0)) == pytest.approx(0.5)
    assert others_busy_cores(before, CpuReading(12.0, 101.0, 42.0)) == 0.0  # counters skew: never below 0
    assert others_busy_cores(before, before) == 0.0


class FakeLoad:
    """Readings in which other processes keep `others` cores busy and this process uses `own` cores."""

    def __init__(self) -> None:
        self.others, self.own = 0.0, 0.0
        self.now = CpuReading(0.0, 0.0, 0.0)

    def advance(self, seconds: float = 1.0) -> None:
        busy = (self.others + self.own) * seconds
        self.now = CpuReading(self.now.wall + seconds, self.now.system_busy + busy, self.now.own + self.own * seconds)

    def read(self) -> CpuReading:
        self.advance()
        return self.now


def test_the_count_drops_at_once_and_grows_back_after_steady_checks():
    load = FakeLoad()
    fitter = ThreadFitter(cores=4, read=load.read, sleep=lambda seconds: None)
    load.others = 3.0            # busy from the start: the first check samples an interval of its own
    assert fitter.choose() == 1
    load.others, load.own = 0.0, 1.0
    assert [fitter.choose(), fitter.choose()] == [1, 4]
    load.own = 4.0
    assert fitter.choose() == 4  # only our own work: all free
    load.others = 3.0            # an app takes three cores
    assert fitter.choose() == 1
    assert threads_module.GROW_AFTER == 2
    load.others = 1.0            # it lets two go: more threads only on the second check in a row
    assert [fitter.choose(), fitter.choose()] == [1, 3]
    load.others = 0.0
    assert [fitter.choose(), fitter.choose()] == [3, 4]
    load.others = 0.9            # a flicker below the count again takes effect at once
    assert fitter.choose() == 3
    with pytest.raises(edgetrain.EdgetrainError, match="max_threads"):
        ThreadFitter(max_threads=0)


def test_a_real_reading_is_counters_that_only_grow():
    first = threads_module.read_cpu()
    sum(i * i for i in range(200_000))
    second = threads_module.read_cpu()
    assert second.wall > first.wall and second.own >= first.own and second.system_busy >= first.system_busy
    assert others_busy_cores(first, second) >= 0.0


@pytest.fixture
def restore_torch_threads():
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


def _learner(threads):
    model = edgetrain.models.zoo.MODEL_PRESETS.get("tiny")()
    edgetrain.add_lora(model, rank=2)
    return edgetrain.Learner(model, method="mesp", optimizer="adamw", lr=1e-2, threads=threads), model


def _batch(model, index: int) -> Batch:
    tokens = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(index))
    return Batch(tokens, tokens, index)


def test_the_learner_sets_the_threads_before_every_step(restore_torch_threads):
    learner, model = _learner(1)
    torch.set_num_threads(2)
    assert learner.step(_batch(model, 0)).threads == 1 and torch.get_num_threads() == 1
    load = FakeLoad()
    fitter = ThreadFitter(cores=2, read=load.read, sleep=lambda seconds: None)
    learner, model = _learner(fitter)
    assert learner.step(_batch(model, 0)).threads == 2
    load.others = 1.0
    assert learner.step(_batch(model, 1)).threads == 1 and torch.get_num_threads() == 1
    learner, model = _learner(None)
    torch.set_num_threads(2)
    assert learner.step(_batch(model, 0)).threads is None and torch.get_num_threads() == 2


def test_the_thread_count_does_not_change_what_a_step_computes(restore_torch_threads):
    """MeSP's LoRA gradients on the tiny model come out the same on 1 and on 2 threads (to fp32 rounding:
    some reductions split by thread)."""
    results = []
    for count in (1, 2):
        torch.manual_seed(0)
        learner, model = _learner(count)
        for index in range(3):
            learner.step(_batch(model, index))
        results.append({name: p.detach().clone() for name, p in learner.params.items()})
    for name, value in results[0].items():
        torch.testing.assert_close(results[1][name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "many", True])
def test_a_bad_thread_count_is_refused_by_name(bad):
    with pytest.raises(edgetrain.EdgetrainError, match="threads"):
        _learner(bad)


def test_the_flags_take_a_count_or_auto_and_the_personaliser_fits_by_default(tmp_path):
    assert threads_flag("auto") == "auto" and threads_flag("3") == 3
    for bad in ("0", "x", "-2"):
        with pytest.raises(argparse.ArgumentTypeError):
            threads_flag(bad)
    personaliser = edgetrain.Personaliser(tmp_path / "store")
    assert isinstance(personaliser.threads, ThreadFitter)
    personaliser.close()
    with pytest.raises(edgetrain.EdgetrainError, match="threads"):
        edgetrain.Personaliser(tmp_path / "other", threads="all")
