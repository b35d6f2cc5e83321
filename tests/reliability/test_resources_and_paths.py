"""Fault class 6, resources and paths, and the resume part of class 7: sizes that overflow, checkpoint
directories that cannot be written or hold strays, orphan temps, a checkpoint interval that would never
checkpoint, a resume after an automatic fallback to another method, and a checkpoint that cannot be
restored. Each is refused by name before any work (or handled), and nothing the learner holds changes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import edgetrain
from edgetrain.training.checkpoint import (atomic_save_safetensors, load_safetensors_checked, rotating_checkpoint_paths,
                                  save_rotating)
from edgetrain.data import make_stream
from edgetrain.training.learner import parse_bytes
from fault_tally import attempt, refused

PATHS, RESUME = "resources and paths", "resume semantics"


def _learner(method: str = "mezo", seed: int = 0, **options):
    torch.manual_seed(seed)
    model = edgetrain.add_lora(edgetrain.load_model("tiny"), rank=2)
    return edgetrain.Learner(model, method=method, optimizer="sgd", lr=1e-3, probe=False, seed=3, **options)


def _stream(start_index: int = 0):
    return make_stream("text", batch_size=2, seq_len=16, vocab_size=256, seed=1, start_index=start_index)


def _state(learner):
    return ({n: p.detach().clone() for n, p in learner.params.items()}, learner.method_name, learner.steps_done,
            learner.stream_position, json.dumps(learner.optimizer.state_dict()["param_groups"]))


def _same(a, b) -> bool:
    return a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and a[1:] == b[1:]


@pytest.mark.parametrize("value", ["1e999", "nan", "inf", "-inf", "NaN GiB", float("inf"), float("nan"), 2 ** 70,
                                   "1e300GiB", "0", "-5MiB", 0, -1, "", "MiB", "12 parsecs", "0x10"])
def test_a_memory_size_that_is_not_a_size_is_refused_by_name(value):
    refused(PATHS, lambda: parse_bytes(value), match="memory size")


@pytest.mark.parametrize("value, expected", [("512MiB", 512 * 2 ** 20), ("1.5 GB", 1_500_000_000), (4096, 4096),
                                             ("1024GiB", 2 ** 40), (2 ** 60, 2 ** 60)])
def test_memory_sizes_are_read_exactly(value, expected):
    attempt(PATHS, lambda: parse_bytes(value), sound=lambda parsed: parsed == expected)


def test_rotation_ignores_strays_named_like_checkpoints(tmp_path):
    (tmp_path / "step-99999999.safetensors").mkdir()  # a directory is not a checkpoint
    (tmp_path / "step-old.safetensors").write_bytes(b"the user's file")
    tensors = {"w": torch.arange(3.0)}
    for step in (1, 2, 3):
        attempt(PATHS, lambda: save_rotating({"w": tensors["w"] * step}, {}, tmp_path, step, keep=2))
    assert [p.name for p in rotating_checkpoint_paths(tmp_path)] == ["step-00000003.safetensors",
                                                                     "step-00000002.safetensors"]
    assert (tmp_path / "step-99999999.safetensors").is_dir()
    assert (tmp_path / "step-old.safetensors").read_bytes() == b"the user's file"


def test_rotation_orders_checkpoints_by_step_number_past_eight_digits(tmp_path):
    for step in (99_999_999, 100_000_000):
        save_rotating({"w": torch.tensor([float(step)])}, {}, tmp_path, step, keep=1)
    # "step-100000000" sorts before "step-99999999" as text: the newest must win by number.
    assert [p.name for p in rotating_checkpoint_paths(tmp_path)] == ["step-100000000.safetensors"]


def test_temps_left_by_a_killed_checkpoint_writer_are_removed_at_the_next_save(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    writer = subprocess.Popen(["sleep", "60"])  # another process, still at work on its temp
    try:
        orphan = tmp_path / f".step-00000004.safetensors.{dead}.0123abcd.tmp"
        live = tmp_path / f".step-00000005.safetensors.{writer.pid}.0123abcd.tmp"
        for path in (orphan, live):
            path.write_bytes(b"half a checkpoint")
        save_rotating({"w": torch.zeros(2)}, {}, tmp_path, 6)
        assert not orphan.exists() and live.exists()
    finally:
        writer.kill()
        writer.wait()


def test_fit_refuses_a_checkpoint_directory_it_cannot_write_before_any_step(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    learner = _learner()
    before = _state(learner)
    stream = _stream()
    refused(PATHS, lambda: learner.fit(stream, max_steps=2, checkpoint_every=1, checkpoint_dir=blocker / "ckpt",
                                       progress=False), match="not a writable directory")
    assert _same(_state(learner), before)


@pytest.mark.parametrize("every, directory", [(0, "ckpt"), (-1, "ckpt"), (2.5, "ckpt"), (True, "ckpt"), (3, None)])
def test_fit_refuses_a_checkpoint_interval_that_would_not_checkpoint(tmp_path, every, directory):
    learner = _learner()
    before = _state(learner)
    stream = _stream()
    refused(PATHS, lambda: learner.fit(stream, max_steps=2, checkpoint_every=every,
                                       checkpoint_dir=None if directory is None else tmp_path / directory,
                                       progress=False), match="checkpoint")
    assert _same(_state(learner), before)


@pytest.mark.parametrize("flags, message", [
    (["--checkpoint-dir", "{tmp}/ckpt", "--checkpoint-every", "0"], "--checkpoint-every 0"),
    (["--checkpoint-dir", "{tmp}/a-file/ckpt"], "--checkpoint-dir"),
    (["--save-adapter", "{tmp}/a-file/adapter.safetensors"], "--save-adapter"),
    (["--save-adapter", "{tmp}"], "--save-adapter")])
def test_the_cli_refuses_outputs_it_could_not_write_before_training(tmp_path, capsys, flags, message):
    from edgetrain.cli import main

    (tmp_path / "a-file").write_text("not a directory")
    argv = ["train", "--model", "tiny", "--steps", "3", "--quiet"] + [f.format(tmp=tmp_path) for f in flags]
    code = attempt(PATHS, lambda: main(argv), sound=lambda code: code == 2)
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "ckpt").exists()


def test_a_run_that_fell_back_to_another_method_resumes_with_it(tmp_path):
    """A run asked for mebp, allowed mezo as a fallback and fell back (the budget did not fit mebp): its
    checkpoints hold mezo, and the same command run again resumes them with mezo, exactly."""
    uninterrupted = _learner("mezo")
    uninterrupted.fit(_stream(), max_steps=4, progress=False)
    first = _learner("mezo")
    first.fit(_stream(), max_steps=2, checkpoint_every=2, checkpoint_dir=tmp_path, progress=False)
    resumed = _learner("mebp", fallback_methods=("mezo",))
    attempt(RESUME, lambda: resumed.resume(tmp_path), sound=lambda path: resumed.method_name == "mezo")
    resumed.fit(_stream(resumed.stream_position), max_steps=4, progress=False)
    assert all(torch.equal(resumed.params[n], p) for n, p in uninterrupted.params.items())
    strict = _learner("mebp")  # no fallback allowed: the checkpoint is not this run's
    before = _state(strict)
    refused(RESUME, lambda: strict.resume(tmp_path), match="written by method 'mezo'")
    assert _same(_state(strict), before)


@pytest.mark.parametrize("damage", ["steps-not-a-number", "negative-position", "optimizer-for-another-model",
                                    "method-state-of-another-method"])
def test_a_checkpoint_that_cannot_be_restored_changes_nothing(tmp_path, damage):
    source = _learner("mezo")
    source.fit(_stream(), max_steps=1,
               checkpoint_every=1, checkpoint_dir=tmp_path, progress=False)
    path = rotating_checkpoint_paths(tmp_path)[0]
    tensors, metadata = load_safetensors_checked(path)
    state = json.loads(metadata["state"])
    if damage == "steps-not-a-number":
        state["steps_done"] = "one"
    elif damage == "negative-position":
        state["stream_position"] = -4
    elif damage == "optimizer-for-another-model":
        state["optimizer"]["param_groups"] = state["optimizer"]["param_groups"] * 2
    else:
        state["method"] = {"unexpected": [1, 2]}
    metadata["state"] = json.dumps(state)
    atomic_save_safetensors(tensors, path, metadata)  # a crafted file: its checksum is valid
    target = _learner("mezo", seed=7)
    before = _state(target)
    refused(RESUME, lambda: target.resume(tmp_path))
    assert _same(_state(target), before)


# -- class 7: a checkpoint knows its data ----------------------------------------------------------------

@pytest.mark.parametrize("change", ["seq_len", "batch_size", "seed", "text", "files"])
def test_resuming_on_other_data_is_refused_by_name_and_allowed_on_request(tmp_path, change):
    (tmp_path / "notes.txt").write_text("the user's own notes, typed on the phone. " * 40)
    same = dict(batch_size=2, seq_len=16, vocab_size=256, seed=1)
    first = _learner()
    first.fit(make_stream("text", **same), max_steps=2, checkpoint_every=2, checkpoint_dir=tmp_path / "ckpt",
              progress=False)
    other = dict(same)
    if change in ("seq_len", "batch_size", "seed"):
        other[change] = same[change] + 1
    elif change == "text":
        other["text"] = "other text entirely. " * 60
    else:
        other["paths"] = [tmp_path / "notes.txt"]
    resumed = _learner()
    resumed.resume(tmp_path / "ckpt")
    before = _state(resumed)
    error = refused(RESUME, lambda: resumed.fit(make_stream("text", start_index=resumed.stream_position, **other),
                                                max_steps=4, progress=False), match="other data")
    assert ("content differs" in str(error)) == (change in ("text", "files"))
    assert _same(_state(resumed), before)
    attempt(RESUME, lambda: resumed.fit(make_stream("text", start_index=resumed.stream_position, **other),
                                        max_steps=4, progress=False, allow_data_change=True),
            sound=lambda history: resumed.steps_done == 4)


def test_resuming_on_the_same_data_goes_on_and_checkpoints_carry_the_fingerprint(tmp_path):
    stream = _stream()
    first = _learner()
    first.fit(stream, max_steps=2, checkpoint_every=2, checkpoint_dir=tmp_path, progress=False)
    metadata = load_safetensors_checked(rotating_checkpoint_paths(tmp_path)[0])[1]
    assert json.loads(metadata["state"])["data"] == stream.fingerprint()
    resumed = _learner()
    resumed.resume(tmp_path)
    attempt(RESUME, lambda: resumed.fit(_stream(resumed.stream_position), max_steps=3, progress=False),
            sound=lambda history: resumed.steps_done == 3)


def test_the_text_stream_keeps_one_byte_per_byte_of_text():
    text = "naïve café ✓ " * 1000
    stream = make_stream("text", text=text, batch_size=2, seq_len=16)
    assert stream.tokens.element_size() * stream.tokens.numel() == len(text.encode("utf-8"))
    batch = next(iter(stream))
    assert batch.inputs.dtype == torch.long and batch.inputs.tolist()[0] == list(text.encode("utf-8")[:16])


def test_the_mlx_learner_refuses_resuming_on_other_data_too(tmp_path):
    pytest.importorskip("mlx.core", reason="mlx is not installed (pip install edgetrain[mlx])")
    from edgetrain.training.learner import Learner
    from edgetrain.backends.mlx.loading import load_mlx_model
    from edgetrain.backends.mlx.lora import add_lora

    def learner() -> Learner:
        model = load_mlx_model("tiny", seed=0)
        add_lora(model, rank=2)
        return Learner(model, backend="mlx", method="bp", optimizer="sgd", lr=1e-3)

    first = learner()
    first.fit(_stream(), max_steps=2, checkpoint_every=2, checkpoint_dir=tmp_path, progress=False)
    resumed = learner()
    resumed.resume(tmp_path)
    other = make_stream("text", batch_size=2, seq_len=8, vocab_size=256, seed=1, start_index=resumed.stream_position)
    refused(RESUME, lambda: resumed.fit(other, max_steps=3, progress=False), match="seq_len 16 -> 8")
    assert resumed.steps_done == 2
