"""Issue 40: a checkpoint whose checksum is right but whose content cannot be.

Each case damages the newest of two rotating checkpoints and writes it again through
atomic_save_safetensors, so its checksum (tensors and metadata, edgetrain.training.checkpoint.payload_sha256)
is valid again: only a check of the content against the learner can see it. Loading that file is refused by
name (CorruptCheckpointError naming the file and what is wrong) and changes nothing; resume skips it with a
warning naming the file and the reason and restores the older checkpoint exactly (weights, optimizer state,
counters), as it does for a file that fails its checksum.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import edgetrain
from edgetrain.data.batch import Batch
from edgetrain.training.checkpoint import (CorruptCheckpointError, atomic_save_safetensors,
                                           flatten_optimizer_state, load_safetensors_checked)
from edgetrain.training.learner import Learner
from fault_tally import checked, refused

CHECKPOINTS = "checkpoint metadata"
PARAM = "param/blocks.0.linear.weight"


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return edgetrain.load_model("mlp-digits")


def _batch(model: torch.nn.Module, seed: int) -> Batch:
    from edgetrain.export import example_batch

    return example_batch(model, 4, 8, seed=seed)


def _learner(seed: int = 0, optimizer: str = "adamw", **options: Any) -> Learner:
    return Learner(_model(seed), method="bp", optimizer=optimizer, lr=1e-2, probe=False,
                   optimizer_options=options or None)


def _two_checkpoints(directory: Path, optimizer: str = "adamw", **options: Any) -> tuple[Path, Path]:
    """step-1 and step-2 of one run in `directory` (each with optimizer state); returns (older, newer)."""
    learner = _learner(optimizer=optimizer, **options)
    for step in (1, 2):
        learner.step(_batch(learner.model, step))
        learner.save_rotating(directory, keep=2)
    return directory / "step-00000001.safetensors", directory / "step-00000002.safetensors"


def _rewrite(path: Path, change: Callable[[dict[str, torch.Tensor], dict], None]) -> None:
    """Damage the checkpoint at `path` by `change(tensors, state)` and write it again with a valid checksum."""
    tensors, metadata = load_safetensors_checked(path)
    state = json.loads(metadata["state"])
    change(tensors, state)
    atomic_save_safetensors(tensors, path, {**metadata, "state": json.dumps(state)})
    load_safetensors_checked(path)  # the checksum passes: only the content is wrong


def _tensor(key: str, make: Callable[[torch.Tensor], torch.Tensor]):
    def change(tensors: dict[str, torch.Tensor], state: dict) -> None:
        tensors[key] = make(tensors[key])
    return change


def _drop(key: str):
    def change(tensors: dict[str, torch.Tensor], state: dict) -> None:
        del tensors[key]
    return change


def _nan_at(value: float):
    def make(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.clone()
        tensor.view(-1)[tensor.numel() // 2] = value
        return tensor
    return make


def _group(key: str, value: Any):
    def change(tensors: dict[str, torch.Tensor], state: dict) -> None:
        state["optimizer"]["param_groups"][0][key] = value
    return change


def _scalar(index: str, key: str, value: Any):
    def change(tensors: dict[str, torch.Tensor], state: dict) -> None:
        state["optimizer"].setdefault("scalars", {}).setdefault(index, {})[key] = value
    return change


# name: (damage, what the error must say)
DAMAGES: dict[str, tuple[Callable, str]] = {
    "param-int32": (_tensor(PARAM, lambda t: t.to(torch.int32)), "torch.int32"),
    "param-float64": (_tensor(PARAM, lambda t: t.double()), "torch.float64"),
    "param-float16": (_tensor(PARAM, lambda t: t.half()), "torch.float16"),
    "param-wrong-shape": (_tensor(PARAM, lambda t: t.t().contiguous()), "has shape (64, 32)"),
    "param-extra-row": (_tensor(PARAM, lambda t: torch.cat([t, t[:1]])), "has shape (33, 64)"),
    "param-scalar": (_tensor(PARAM, lambda t: t.reshape(-1)[0].clone()), "has shape ()"),
    "param-missing": (_drop(PARAM), "is missing"),
    "param-nan": (_tensor(PARAM, _nan_at(math.nan)), "non-finite"),
    "param-inf": (_tensor(PARAM, _nan_at(math.inf)), "non-finite"),
    "param-minus-inf": (_tensor("param/head.bias", _nan_at(-math.inf)), "non-finite"),
    "exp-avg-wrong-shape": (_tensor("optimizer/0/exp_avg", lambda t: t[:, :10].contiguous()), "exp_avg"),
    "exp-avg-transposed": (_tensor("optimizer/2/exp_avg", lambda t: t.t().contiguous()), "exp_avg"),
    "exp-avg-int": (_tensor("optimizer/1/exp_avg", lambda t: t.to(torch.int64)), "not a floating-point type"),
    "exp-avg-nan": (_tensor("optimizer/0/exp_avg", _nan_at(math.nan)), "non-finite"),
    "exp-avg-sq-inf": (_tensor("optimizer/3/exp_avg_sq", _nan_at(math.inf)), "non-finite"),
    "exp-avg-sq-negative": (_tensor("optimizer/0/exp_avg_sq", lambda t: -t - 1), "negative"),
    "step-negative": (_tensor("optimizer/0/step", lambda t: t - 100), "step count"),
    "step-nan": (_tensor("optimizer/1/step", lambda t: t * math.nan), "step count"),
    "optimizer-state-of-no-parameter": (_tensor("optimizer/0/exp_avg", lambda t: t), "parameter 9"),
    "lr-1e30": (_group("lr", 1e30), "1e+30"),
    "lr-nan": (_group("lr", math.nan), "learning rate"),
    "lr-negative": (_group("lr", -0.01), "learning rate"),
    "lr-string": (_group("lr", "fast"), "learning rate"),
    "betas-above-one": (_group("betas", [1.5, 0.999]), "betas"),
    "betas-one-value": (_group("betas", [0.9]), "betas"),
    "eps-negative": (_group("eps", -1e-8), "eps"),
    "weight-decay-inf": (_group("weight_decay", math.inf), "weight_decay"),
    "amsgrad-string": (_group("amsgrad", "yes"), "amsgrad"),
    "group-params-reordered": (_group("params", [3, 2, 1, 0]), "holds parameters"),
    "group-params-short": (_group("params", [0, 1]), "holds parameters"),
    "scalar-not-a-number": (_scalar("0", "sneaky", "x"), "not a finite number"),
    "rng-wrong-shape": (_tensor("rng/torch", lambda t: t[:100].clone()), "RNG state"),
    "rng-float": (_tensor("rng/torch", lambda t: t.float()), "RNG state"),
}


def _no_parameter_nine(tensors: dict[str, torch.Tensor], state: dict) -> None:
    tensors["optimizer/9/exp_avg"] = tensors["optimizer/0/exp_avg"].clone()


DAMAGES["optimizer-state-of-no-parameter"] = (_no_parameter_nine, "parameter 9")


def _learner_state(learner: Learner) -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {f"param/{name}": p.detach().clone() for name, p in learner.params.items()}
    optimizer_tensors, rest = flatten_optimizer_state(learner.optimizer.state_dict())
    tensors.update({k: v.clone() for k, v in optimizer_tensors.items()})
    return tensors, json.loads(json.dumps({"rest": rest, "steps": [learner.steps_done, learner.stream_position]}))


def _equals_file(learner: Learner, path: Path) -> bool:
    """The learner's weights, optimizer state and counters are those of the checkpoint at `path`, exactly."""
    tensors, metadata = load_safetensors_checked(path)
    state = json.loads(metadata["state"])
    mine, rest = _learner_state(learner)
    saved = {k: v for k, v in tensors.items() if k.startswith(("param/", "optimizer/"))}
    return (mine.keys() == saved.keys() and all(torch.equal(mine[k], saved[k]) for k in saved)
            and rest["rest"] == state["optimizer"]
            and rest["steps"] == [state["steps_done"], state["stream_position"]])


def _same(a, b) -> bool:
    return a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and a[1] == b[1]


@pytest.mark.parametrize("name", sorted(DAMAGES))
def test_a_rechecksummed_checkpoint_whose_content_cannot_be_is_refused_and_resume_falls_back(name, tmp_path,
                                                                                           caplog):
    damage, says = DAMAGES[name]
    older, newer = _two_checkpoints(tmp_path)
    _rewrite(newer, damage)
    # Loading the file itself: refused by name, and nothing changes.
    target = _learner(seed=7)
    before = _learner_state(target)
    error = refused(CHECKPOINTS, lambda: target.load(newer))
    assert isinstance(error, CorruptCheckpointError) and str(newer) in str(error) and says in str(error), error
    assert _same(_learner_state(target), before)
    # Resume: the warning names the file and the reason, and the older checkpoint is restored exactly.
    resumed = _learner(seed=7)
    with caplog.at_level(logging.WARNING), checked(CHECKPOINTS):
        assert resumed.resume(tmp_path) == older
        assert _equals_file(resumed, older)
        warning = caplog.text
        assert "skipping" in warning and str(newer) in warning and says in warning, warning
        resumed.step(_batch(resumed.model, 3))  # and training goes on from it
        assert all(bool(torch.isfinite(p).all()) for p in resumed.params.values())


@pytest.mark.parametrize("name", ["param-int32", "exp-avg-wrong-shape", "param-nan", "lr-1e30"])
def test_with_no_good_checkpoint_left_resume_is_refused_and_nothing_changes(name, tmp_path):
    damage, says = DAMAGES[name]
    older, newer = _two_checkpoints(tmp_path)
    _rewrite(older, damage)
    _rewrite(newer, damage)
    target = _learner(seed=7)
    before = _learner_state(target)
    error = refused(CHECKPOINTS, lambda: target.resume(tmp_path), match="every checkpoint")
    assert str(older) in str(error) and str(newer) in str(error) and says in str(error)
    assert _same(_learner_state(target), before) and target.steps_done == 0


@pytest.mark.parametrize("damage", ["wrong-shape", "nan", "negative-momentum"])
def test_sgd_momentum_state_is_checked_too(damage, tmp_path, caplog):
    older, newer = _two_checkpoints(tmp_path, optimizer="sgd", momentum=0.9)
    key = "optimizer/0/momentum_buffer"
    change = {"wrong-shape": _tensor(key, lambda t: t[:4].contiguous()),
              "nan": _tensor(key, _nan_at(math.nan)),
              "negative-momentum": _group("momentum", -0.9)}[damage]
    _rewrite(newer, change)
    refused(CHECKPOINTS, lambda: _learner(seed=7, optimizer="sgd", momentum=0.9).load(newer))
    resumed = _learner(seed=7, optimizer="sgd", momentum=0.9)
    with checked(CHECKPOINTS):
        assert resumed.resume(tmp_path) == older and _equals_file(resumed, older)


def test_sound_checkpoints_still_resume_exactly(tmp_path):
    """The checks refuse nothing a real run writes: Adam, AdamW with amsgrad, SGD with momentum."""
    for optimizer, options in (("adam", {}), ("adamw", {"amsgrad": True}), ("sgd", {"momentum": 0.9})):
        directory = tmp_path / optimizer
        _, newer = _two_checkpoints(directory, optimizer, **options)
        resumed = _learner(seed=7, optimizer=optimizer, **options)
        with checked(CHECKPOINTS):
            assert resumed.resume(directory) == newer and _equals_file(resumed, newer)


# -- the MLX learner: the same checkpoint path, its engine's checks --------------------------------------

MLX_DAMAGES = {
    "param-nan": lambda key: _tensor(key, _nan_at(math.nan)),
    "param-wrong-shape": lambda key: _tensor(key, lambda t: t.t().contiguous()),
    "param-int32": lambda key: _tensor(key, lambda t: t.to(torch.int32)),
    "param-missing": lambda key: _drop(key),
    "lr-1e30": lambda key: _tensor("optimizer/learning_rate", lambda t: torch.full_like(t, 1e30)),
    "step-negative": lambda key: _tensor("optimizer/step", lambda t: t - 100),
}


@pytest.mark.parametrize("name", sorted(MLX_DAMAGES))
def test_the_mlx_learner_falls_back_past_a_checkpoint_whose_content_cannot_be(name, tmp_path, caplog):
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed")
    import numpy as np

    from edgetrain.backends.mlx.loading import load_mlx_model
    from edgetrain.backends.mlx.lora import add_lora
    from edgetrain.data.text import TextStream

    def learner() -> Learner:
        model = load_mlx_model("tiny", seed=0)
        add_lora(model, rank=2)
        return Learner(model, backend="mlx", method="bp", optimizer="adamw", lr=1e-2, probe=False)

    stream = TextStream(seq_len=16, batch_size=2)
    first = learner()
    for step in (1, 2):
        first.step(stream.batch(step))
        first.save_rotating(tmp_path, keep=2)
    older, newer = tmp_path / "step-00000001.safetensors", tmp_path / "step-00000002.safetensors"
    key = next(k for k in load_safetensors_checked(newer)[0] if k.startswith("param/"))
    _rewrite(newer, MLX_DAMAGES[name](key))
    refused(CHECKPOINTS, lambda: learner().load(newer))
    resumed = learner()
    with caplog.at_level(logging.WARNING), checked(CHECKPOINTS):
        assert resumed.resume(tmp_path) == older and resumed.steps_done == 1
        saved = load_safetensors_checked(older)[0]
        assert all(np.array_equal(np.array(p.astype(mx.float32)), saved[f"param/{n}"].float().numpy())
                   for n, p in resumed.params.items())
        assert "skipping" in caplog.text and str(newer) in caplog.text
