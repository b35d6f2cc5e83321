"""A resumed run is the uninterrupted run: stream position, optimizer state, RNG state, the method's
seeds (tangents, perturbations) and the learning-rate schedule all come back from the checkpoint.

Each case is chosen so that every piece of state matters to the next steps: LoRA dropout draws from the
torch RNG, AdamW / momentum carry optimizer state, fgd and mezo draw their directions from (seed, step),
the cosine schedule's rate changes every step, and the stream is shuffled. The resumed learner is built
the way a new process would build it (same constructor arguments, the global RNG disturbed), so
anything the checkpoint fails to carry shows up as a different loss, rate or weight.
"""
from __future__ import annotations

import pytest
import torch

import edgetrain
from edgetrain.data import text_stream

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS, SPLIT = 6, 3
SCHEDULE = dict(lr_schedule="cosine", schedule_options={"warmup_steps": 2, "total_steps": 8, "min_lr_ratio": 0.1})
CASES = {
    "bp-adamw-dropout": dict(method="bp", optimizer="adamw", lr=3e-3, lora=dict(rank=4, dropout=0.2)),
    "fgd-sgd-momentum": dict(method="fgd", optimizer="sgd", lr=1e-3, optimizer_options={"momentum": 0.9},
                             method_options={"seed": 7}, lora=dict(rank=4)),
    "mezo-sgd": dict(method="mezo", optimizer="sgd", lr=1e-3, method_options={"seed": 11}, lora=dict(rank=4)),
    "mesp-adam": dict(method="mesp", optimizer="adam", lr=3e-3, lora=dict(rank=4)),
}


def _learner(case: dict) -> edgetrain.Learner:
    torch.manual_seed(0)  # the frozen base comes from the base model, the same in every process
    model = edgetrain.load_model("tiny")
    edgetrain.add_lora(model, **case["lora"])
    with torch.no_grad():  # B = 0 makes every A gradient zero; start from a point that trains every tensor
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.normal_(0, 0.02)
    options = {k: v for k, v in case.items() if k not in ("lora",)}
    return edgetrain.Learner(model, seed=5, probe=False, **{**SCHEDULE, **options})


def _stream(start_index: int):
    return text_stream(seq_len=16, batch_size=2, shuffle=True, seed=3, start_index=start_index)


def _run(learner: edgetrain.Learner, steps: int, start_index: int) -> list[tuple[int, float, float]]:
    record = []
    for _, batch in zip(range(steps), _stream(start_index)):
        stats = learner.step(batch)
        record.append((batch.index, stats.loss, stats.lr))
    return record


def _state(learner: edgetrain.Learner) -> dict[str, torch.Tensor]:
    tensors, metadata = learner._checkpoint_payload()
    return {k: v.clone() for k, v in tensors.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_resumed_run_equals_the_uninterrupted_run(name, tmp_path):
    case = CASES[name]
    straight = _learner(case)
    straight_record = _run(straight, STEPS, 0)

    first = _learner(case)
    first_record = _run(first, SPLIT, 0)
    first.save(tmp_path / "ckpt.safetensors")
    del first

    torch.manual_seed(1234)  # a new process: whatever the global RNG holds now must not matter
    resumed = _learner(case).load(tmp_path / "ckpt.safetensors")
    assert (resumed.steps_done, resumed.stream_position) == (SPLIT, SPLIT)
    resumed_record = _run(resumed, STEPS - SPLIT, resumed.stream_position)

    # Same batches (stream position), same rates (schedule), same losses, bit for bit.
    assert first_record + resumed_record == straight_record
    assert len({lr for _, _, lr in straight_record}) == STEPS  # the schedule really moved every step
    expected, got = _state(straight), _state(resumed)
    assert expected.keys() == got.keys()
    different = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not different, f"differs after resume: {different}"
    assert resumed.method.state_dict() == straight.method.state_dict()


def test_resume_refuses_a_different_schedule_or_rate(tmp_path):
    """Rates that changed silently on resume would make a run that was never checkpointed."""
    case = CASES["bp-adamw-dropout"]
    learner = _learner(case)
    _run(learner, 1, 0)
    learner.save(tmp_path / "ckpt.safetensors")
    with pytest.raises(edgetrain.EdgetrainError, match="lr schedule"):
        _learner(dict(case, lr_schedule="linear")).load(tmp_path / "ckpt.safetensors")
    with pytest.raises(edgetrain.EdgetrainError, match="learning rate"):
        _learner(dict(case, lr=1e-2)).load(tmp_path / "ckpt.safetensors")


@pytest.mark.parametrize("method", ["bp", "mezo", "mesp"])
def test_mlx_resumed_run_equals_the_uninterrupted_run(method, tmp_path):
    """The MLX learner: the same promise (its RNG is reseeded from (seed, step), so it holds no RNG state)."""
    pytest.importorskip("mlx.core", reason="mlx is not installed (pip install edgetrain[mlx])")
    import numpy as np

    from edgetrain.backends.mlx.loading import load_mlx_model
    from edgetrain.backends.mlx.lora import add_lora
    from edgetrain.training.learner import Learner

    def learner() -> Learner:
        model = load_mlx_model("tiny", seed=0)
        add_lora(model, rank=4, dropout=0.1 if method == "bp" else 0.0)  # mesp refuses dropout
        return Learner(model, backend="mlx", method=method, optimizer="sgd" if method == "mezo" else "adamw", lr=3e-3,
                          method_options={"seed": 3} if method == "mezo" else {}, **SCHEDULE)

    def run(target: Learner, steps: int, start: int) -> list[tuple[int, float, float]]:
        return [(b.index, (stats := target.step(b)).loss, stats.lr) for _, b in zip(range(steps), _stream(start))]

    straight = learner()
    straight_record = run(straight, STEPS, 0)
    first = learner()
    first_record = run(first, SPLIT, 0)
    first.save(tmp_path / "mlx.safetensors")
    resumed = learner().load(tmp_path / "mlx.safetensors")
    resumed_record = run(resumed, STEPS - SPLIT, resumed.stream_position)
    assert first_record + resumed_record == straight_record
    assert len({lr for _, _, lr in straight_record}) == STEPS
    for name, value in straight.params.items():
        np.testing.assert_array_equal(np.array(resumed.params[name]), np.array(value), err_msg=name)
