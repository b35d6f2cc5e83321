"""Fault class 6, the budget guard: a first step far over the memory budget is refused on a slice of the
batch, before the whole batch allocates anything; and the slices it measures leave no trace in a run
whose step fits (edgetrain/training/memory_estimate.py)."""
from __future__ import annotations

import re

import pytest
import torch

import edgetrain
from edgetrain.data.batch import Batch
from edgetrain.training.learner import MemoryBudgetError
from edgetrain.training.memory_estimate import batch_slices
from edgetrain.probes import TensorAccountant
from fault_tally import refused


class RecordingProbe:
    """Tensor accounting (exact and deterministic) that remembers every peak it measured."""

    name = "tensors"

    def __init__(self, model: torch.nn.Module) -> None:
        self.accountant = TensorAccountant(model)
        self.peaks: list[int] = []

    def available(self) -> tuple[bool, str]:
        return True, ""

    def reset_peak(self) -> None:
        self.accountant.reset_peak()

    def current_bytes(self) -> int:
        return self.accountant.current_bytes()

    def peak_bytes(self) -> int:
        peak = self.accountant.peak_bytes()
        self.peaks.append(peak - self.accountant.current_bytes())
        return peak

    def __enter__(self):
        return self.accountant.__enter__()

    def __exit__(self, *exc):
        return self.accountant.__exit__(*exc)


def _full_step_peak(tiny_lora, batch: Batch, method: str = "bp") -> int:
    model = tiny_lora()
    accountant = TensorAccountant(model)
    learner = edgetrain.Learner(model, method=method, probe=accountant)
    return learner.step(batch).peak_bytes


def test_a_step_far_over_the_budget_is_refused_on_a_slice_before_the_whole_batch_runs(tiny_lora, text_batches):
    batch = text_batches(1, seq_len=256, batch_size=4)[0]
    full_peak = _full_step_peak(tiny_lora, batch)
    model = tiny_lora()
    weights = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    # The whole step needs 13x the room the budget leaves above the weights.
    budget = weights + full_peak // 13
    probe = RecordingProbe(model)
    learner = edgetrain.Learner(model, method="bp", optimizer="adam", probe=probe, memory_budget=budget)
    seen_tokens: list[int] = []
    step = learner.method.step
    learner.method.step = lambda b, optimizer: (seen_tokens.append(b.inputs.numel()), step(b, optimizer))[1]
    before = {name: p.detach().clone() for name, p in learner.params.items()}

    error = refused("resources and paths", lambda: learner.step(batch))
    assert isinstance(error, MemoryBudgetError)
    assert re.search(r"over the memory budget .* it adds bp: over [\d.,]+ MiB \(measured on \d+ of the batch's 1024 "
                     r"tokens\)", str(error)), error
    assert seen_tokens and max(seen_tokens) < batch.inputs.numel(), "the whole batch ran before the refusal"
    # At most about twice the room: each slice at most doubles the last one that fitted.
    assert max(probe.peaks) <= 2.5 * (budget - weights) < full_peak / 4
    assert all(torch.equal(before[name], p) for name, p in learner.params.items())
    assert learner.optimizer.state_dict()["state"] == {} and learner.steps_done == 0


def test_a_slice_over_budget_makes_the_learner_fall_back_without_running_the_whole_batch(tiny_lora, text_batches):
    batch = text_batches(1, seq_len=256, batch_size=4)[0]
    bp_peak, mezo_peak = _full_step_peak(tiny_lora, batch), _full_step_peak(tiny_lora, batch, "mezo")
    room = int(1.1 * mezo_peak)
    assert bp_peak > 3 * room  # so that half of bp's step is over the budget already
    model = tiny_lora()
    weights = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    learner = edgetrain.Learner(model, method="bp", probe=RecordingProbe(model), memory_budget=weights + room,
                                fallback_methods=("mezo",))
    bp_tokens: list[int] = []
    step = learner.method.step
    learner.method.step = lambda b, optimizer: (bp_tokens.append(b.inputs.numel()), step(b, optimizer))[1]
    stats = learner.step(batch)
    assert learner.method_name == "mezo" and stats.step == 1
    assert bp_tokens and max(bp_tokens) < batch.inputs.numel(), "bp ran the whole batch before falling back"


@pytest.mark.parametrize("method, optimizer, options", [
    ("bp", "adam", {}), ("mesp", "adam", {}), ("mezo", "sgd", {}), ("fgd", "sgd", {}), ("mebp", "adamw", {})])
def test_the_measured_slices_leave_no_trace_when_the_step_fits(tiny_lora, text_batches, method, optimizer, options):
    batches = text_batches(3, seq_len=64, batch_size=4)

    def run(memory_budget):
        learner = edgetrain.Learner(tiny_lora(), method=method, optimizer=optimizer, lr=1e-2, seed=3,
                                    method_options=options, memory_budget=memory_budget, lr_schedule="linear-warmup",
                                    schedule_options={"warmup_steps": 3}, probe="tensors")
        losses = [learner.step(b).loss for b in batches]
        return learner, losses

    guarded, guarded_losses = run("64GiB")
    plain, plain_losses = run(None)
    assert guarded_losses == plain_losses
    assert all(torch.equal(p, plain.params[name]) for name, p in guarded.params.items())
    assert guarded.steps_done == 3 and guarded.stream_position == plain.stream_position
    assert guarded.method.state_dict().keys() == plain.method.state_dict().keys()
    assert repr(guarded.method.state_dict()) == repr(plain.method.state_dict())


def test_batch_slices_are_growing_prefixes_smaller_than_the_batch(text_batches):
    for batch in (text_batches(1, seq_len=64, batch_size=16)[0], text_batches(1, seq_len=64, batch_size=2)[0],
                  text_batches(1, seq_len=5, batch_size=1)[0]):
        slices = batch_slices(batch)
        sizes = [s.inputs.numel() for s in slices]
        assert sizes == sorted(set(sizes)) and all(size < batch.inputs.numel() for size in sizes)
        for piece in slices:
            rows, columns = piece.inputs.shape
            assert torch.equal(piece.inputs, batch.inputs[:rows, :columns])
            assert torch.equal(piece.targets, batch.targets[:rows, :columns]) and piece.index == batch.index
    assert [s.inputs.shape for s in batch_slices(text_batches(1, seq_len=64, batch_size=16)[0])] == [
        (2, 64), (4, 64), (8, 64)]
    assert [s.inputs.shape for s in batch_slices(text_batches(1, seq_len=64, batch_size=2)[0])] == [
        (1, 16), (1, 32), (1, 64)]
    classifier = Batch(torch.randn(8, 3), torch.arange(8), 0)
    assert [s.inputs.shape[0] for s in batch_slices(classifier)] == [1, 2, 4]
    assert batch_slices(Batch(torch.randn(1, 3), torch.tensor([0]), 0)) == []
