"""Threads that fit the cores the device has free (edgetrain.training.threads): the choice from fake load
readings, the learner and the personaliser applying it between steps, the flags."""
from __future__ import annotations

import argparse
import json
import logging

import pytest
import torch

import edgetrain
from edgetrain.data.batch import Batch
from edgetrain.training import threads as threads_module
from edgetrain.training.checkpoint import CorruptCheckpointError, atomic_save_safetensors, load_latest_good
from edgetrain.training.threads import (
    CpuReading,
    ThreadFitter,
    add_step,
    describe_runs,
    fit_threads,
    others_busy_cores,
    resume_note,
    threads_flag,
    usable_cores,
)


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


def test_steps_are_counted_as_runs_of_one_thread_count():
    runs: list[list] = []
    for count in (2, 2, 1, None, None):
        add_step(runs, count)
    assert runs == [[2, 2], [1, 1], [None, 2]]
    assert describe_runs(runs) == "threads 2 x 2, then 1 x 1, then the framework's own x 2 steps"


@pytest.mark.parametrize("runs, going_on, noted", [
    ([[2, 5]], 2, False), ([[2, 5]], "auto", False), ([], "auto", False), ([[None, 4]], None, False),
    ([[2, 5]], 1, True), ([[2, 3], [1, 2]], "auto", True), ([[2, 3], [1, 2]], 2, True), ([[None, 4]], 2, True)])
def test_a_resume_is_noted_where_the_steps_did_not_all_take_one_count(runs, going_on, noted):
    threads = ThreadFitter(cores=2) if going_on == "auto" else going_on
    note = resume_note(runs, threads)
    assert (note is not None) == noted
    if noted:
        assert describe_runs(runs) in note and "bit for bit" in note


def _fitted_learner(load: FakeLoad):
    return _learner(ThreadFitter(cores=2, read=load.read, sleep=lambda seconds: None))


def test_checkpoints_record_each_steps_count_and_a_resume_says_what_mixed_counts_mean(
        tmp_path, caplog, restore_torch_threads):
    load = FakeLoad()
    learner, model = _fitted_learner(load)
    for index in range(3):
        load.others = 1.0 if index == 2 else 0.0  # another process takes one core before the third step
        learner.step(_batch(model, index))
    assert learner.thread_runs == [[2, 2], [1, 1]]
    learner.save_rotating(tmp_path)
    assert json.loads(load_latest_good(tmp_path)[2]["state"])["threads"] == [[2, 2], [1, 1]]
    resumed, model = _learner(2)
    with caplog.at_level(logging.INFO, logger="edgetrain"):
        resumed.resume(tmp_path)
    assert resumed.thread_runs == [[2, 2], [1, 1]] and resumed.steps_done == 3
    assert "threads 2 x 2, then 1 x 1 steps, and this run goes on with threads 2" in caplog.text
    resumed.step(_batch(model, 3))
    assert resumed.thread_runs == [[2, 2], [1, 1], [2, 1]]


def test_one_count_throughout_resumes_without_a_note(tmp_path, caplog, restore_torch_threads):
    learner, model = _learner(1)
    learner.step(_batch(model, 0))
    learner.save_rotating(tmp_path)
    resumed, _ = _learner(1)
    with caplog.at_level(logging.INFO, logger="edgetrain"):
        resumed.resume(tmp_path)
    assert resumed.thread_runs == [[1, 1]] and "its steps ran on" not in caplog.text


def _rewritten_state(tmp_path, change):
    """A checkpoint of one step whose state JSON `change` edited (checksum recomputed, as a writer would)."""
    learner, model = _learner(1)
    learner.step(_batch(model, 0))
    learner.save_rotating(tmp_path / "written")
    _, tensors, metadata = load_latest_good(tmp_path / "written")
    state = json.loads(metadata["state"])
    change(state)
    return atomic_save_safetensors(tensors, tmp_path / "edited.safetensors", {**metadata, "state": json.dumps(state)})


def test_a_checkpoint_from_before_the_record_loads_with_its_counts_unknown(tmp_path, restore_torch_threads):
    path = _rewritten_state(tmp_path, lambda state: state.pop("threads"))
    learner, model = _learner(1)
    learner.load(path)
    assert learner.steps_done == 1 and learner.thread_runs == []
    learner.step(_batch(model, 1))
    assert learner.thread_runs == [[1, 1]]


@pytest.mark.parametrize("runs", ["1", [[0, 1]], [[True, 1]], [[1, 0]], [[1]], [[1, 2]], [[2.0, 1]]])
def test_a_damaged_thread_record_is_refused_like_a_damaged_file(tmp_path, runs, restore_torch_threads):
    path = _rewritten_state(tmp_path, lambda state: state.update(threads=runs))
    learner, _ = _learner(1)
    with pytest.raises(CorruptCheckpointError, match="threads"):
        learner.load(path)
    assert learner.steps_done == 0 and learner.thread_runs == []


def test_a_backend_that_sizes_its_own_pool_warns_for_a_count_and_notes_auto(caplog, restore_torch_threads):
    for threads, level in ((1, logging.WARNING), ("auto", logging.INFO)):
        learner, model = _learner(threads)
        learner.engine.set_threads = lambda count: False  # as the MLX engine answers
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="edgetrain"):
            assert learner.step(_batch(model, 0)).threads is None
        assert [r.levelno for r in caplog.records if "sizes its own thread pool" in r.message] == [level]
        assert learner.thread_runs == [[None, 1]]


def test_the_train_command_fits_threads_by_default_records_them_and_resumes(tmp_path, restore_torch_threads):
    from edgetrain.cli import main
    from edgetrain.cli.train import _torch_own_threads, build_parser, learner_threads

    assert build_parser(argparse.ArgumentParser()).parse_args([]).threads == "auto"
    assert learner_threads("auto").max_threads == _torch_own_threads() and learner_threads(3) == 3
    command = ["train", "--model", "tiny", "--method", "bp", "--seq", "16", "--batch", "2", "--rank", "2",
               "--quiet", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "1"]
    caller = usable_cores() + 1  # a count auto never picks
    torch.set_num_threads(caller)
    for steps in (3, 5):
        assert main(command + ["--steps", str(steps)]) == 0
        assert torch.get_num_threads() == caller  # the caller's count, given back
        state = json.loads(load_latest_good(tmp_path)[2]["state"])
        assert state["steps_done"] == steps and sum(n for _, n in state["threads"]) == steps
        assert all(1 <= count <= min(_torch_own_threads(), usable_cores()) for count, _ in state["threads"])
