"""Fault class 3, files that are not what they claim: a model directory whose files are FIFOs, devices or
directories, JSON nested past the parser or holding NaN, weights of the wrong kind, a shard index that
names no file, configs whose values only look right. Each is refused with a named error that says which
file, by the torch loader and the MLX loader alike, and never hangs."""
from __future__ import annotations

import importlib.util
import json
import os
import select
import signal

import pytest
import torch
from safetensors.torch import load_file, save_file

import edgetrain
from edgetrain.files.user import MAX_JSON_BYTES
from fault_tally import attempt, record, refused

FAULT = "hostile model files"


def _load_torch(directory):
    return edgetrain.load_model(directory)


def _load_mlx(directory):
    from edgetrain.backends.mlx.loading import load_mlx_model

    return load_mlx_model(directory)


LOADERS = [pytest.param(_load_torch, id="torch"),
           pytest.param(_load_mlx, id="mlx", marks=pytest.mark.skipif(
               importlib.util.find_spec("mlx") is None, reason="mlx is not installed (pip install -e '.[mlx]')"))]


def _refused_in_time(load, directory, match: str, seconds: float = 60.0) -> str:
    """load(directory) must raise a named error naming `match` within `seconds`. It runs in a forked
    child: a reader blocked on a FIFO inside native code holds the GIL and ignores signals, so neither a
    thread nor an alarm could stop it; the child is killed instead and the test fails."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the child: report the outcome as one line and leave without running pytest's exit
        os.close(read_end)
        try:
            load(directory)
            report = "accepted\t"
        except edgetrain.EdgetrainError as exc:
            report = f"refused\t{exc}"
        except BaseException as exc:
            report = f"unhandled\t{exc!r}"
        os.write(write_end, report.encode("utf-8", "replace"))
        os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], seconds)
        if not ready:
            os.kill(child, signal.SIGKILL)
            record(FAULT, "unhandled")
            pytest.fail(f"loading {directory} still blocks after {seconds} s")
        with os.fdopen(read_end, "rb", closefd=False) as pipe:
            outcome, _, message = pipe.read().decode("utf-8").partition("\t")
    finally:
        os.close(read_end)
        os.waitpid(child, 0)
    record(FAULT, "silently wrong" if outcome == "accepted" else outcome)
    assert outcome == "refused", f"{outcome}: {message}"
    assert match in message, message
    return message


def _edit_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("load", LOADERS)
@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_a_file_that_is_not_a_regular_file_is_refused_without_blocking(copy_checkpoint, load, name, kind):
    directory = copy_checkpoint()
    (directory / name).unlink()
    if kind == "fifo":
        os.mkfifo(directory / name)
    elif kind == "directory":
        (directory / name).mkdir()
    else:
        (directory / name).symlink_to("/dev/zero")
    message = _refused_in_time(load, directory, match=name)
    assert {"fifo": "FIFO", "directory": "directory", "device": "device"}[kind] in message


@pytest.mark.parametrize("load", LOADERS)
def test_a_shard_named_by_the_index_that_is_a_fifo_is_refused(copy_checkpoint, load):
    directory = copy_checkpoint()
    tensors = load_file(str(directory / "model.safetensors"))
    (directory / "model.safetensors").unlink()
    keys = sorted(tensors)
    save_file({k: tensors[k] for k in keys[:3]}, str(directory / "model-1.safetensors"))
    os.mkfifo(directory / "model-2.safetensors")
    weight_map = {k: "model-1.safetensors" if i < 3 else "model-2.safetensors" for i, k in enumerate(keys)}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _refused_in_time(load, directory, match="model-2.safetensors")


@pytest.mark.parametrize("load", LOADERS)
@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_json_nested_past_the_parser_is_a_named_error(copy_checkpoint, load, name):
    directory = copy_checkpoint()
    depth = 200_000
    (directory / name).write_text('{"weight_map": ' * (name != "config.json") + "[" * depth + "]" * depth
                                  + "}" * (name != "config.json"))
    refused(FAULT, lambda: load(directory), match="nested too deeply")


@pytest.mark.parametrize("load", LOADERS)
@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_json_numbers_that_are_not_finite_are_refused(copy_checkpoint, load, text):
    directory = copy_checkpoint()
    raw = (directory / "config.json").read_text()
    (directory / "config.json").write_text(raw[:-1] + f', "rope_theta": {text}}}')
    refused(FAULT, lambda: load(directory), match="config.json")


def test_a_config_larger_than_any_config_is_refused_before_parsing(copy_checkpoint):
    directory = copy_checkpoint()
    raw = (directory / "config.json").read_text()
    (directory / "config.json").write_text(raw[:-1] + ', "padding": "' + "x" * MAX_JSON_BYTES + '"}')
    refused(FAULT, lambda: edgetrain.load_model(directory), match="larger than")


@pytest.mark.parametrize("load", LOADERS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.uint8])
def test_integer_or_bool_weights_are_refused(copy_checkpoint, load, dtype):
    directory = copy_checkpoint()
    tensors = load_file(str(directory / "model.safetensors"))
    key = "model.layers.0.self_attn.q_proj.weight"
    tensors[key] = tensors[key].to(dtype)
    save_file(tensors, str(directory / "model.safetensors"))
    refused(FAULT, lambda: load(directory), match="floating point")


@pytest.mark.parametrize("load", LOADERS)
@pytest.mark.parametrize("weight_map", [
    {"model.embed_tokens.weight": 7}, {"model.embed_tokens.weight": None}, {"model.embed_tokens.weight": ["a"]},
    {"model.embed_tokens.weight": ""}, {"model.embed_tokens.weight": ".."}, {}, [], "model.safetensors", None])
def test_a_shard_index_whose_weight_map_names_no_file_is_refused(copy_checkpoint, load, weight_map):
    directory = copy_checkpoint()
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    refused(FAULT, lambda: load(directory), match="model.safetensors.index.json")


@pytest.mark.parametrize("load", LOADERS)
@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3"}, {"type": "llama3"}, {"rope_type": "llama3", "factor": "8"},
    {"rope_type": "llama3", "factor": 0}, {"rope_type": "llama3", "factor": True},
    {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 4},
    {"rope_type": "llama3", "factor": 8, "low_freq_factor": -1},
    {"rope_type": "llama3", "factor": 8, "original_max_position_embeddings": 1.5},
    {"rope_type": "llama3", "factor": 8, "original_max_position_embeddings": "8192"},
    {"rope_type": "yarn", "factor": 4}, ["llama3"]])
def test_rope_scaling_that_cannot_be_computed_is_refused_at_load(copy_checkpoint, load, scaling):
    directory = copy_checkpoint()
    _edit_config(directory, rope_scaling=scaling)
    refused(FAULT, lambda: load(directory), match="rope_scaling")


@pytest.mark.parametrize("load", LOADERS)
@pytest.mark.parametrize("field", ["tie_word_embeddings", "attention_bias", "mlp_bias"])
@pytest.mark.parametrize("value", ["false", "true", 0, 1, [], {}])
def test_flags_that_are_not_booleans_are_refused(copy_checkpoint, load, field, value):
    directory = copy_checkpoint()
    _edit_config(directory, **{field: value})
    refused(FAULT, lambda: load(directory), match=field)


def test_llama3_scaling_written_with_the_older_type_key_is_applied(copy_checkpoint):
    """`"type": "llama3"` (older configs) means the same scaling as `"rope_type": "llama3"`, not none."""
    from edgetrain.models.llama import rope_inverse_frequencies

    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    frequencies = {}
    for key in ("type", "rope_type"):
        directory = copy_checkpoint(key)
        _edit_config(directory, rope_scaling={key: "llama3", **scaling})
        model = attempt(FAULT, lambda: edgetrain.load_model(directory),
                        sound=lambda model: model.config.rope_scaling is not None)
        frequencies[key] = rope_inverse_frequencies(model.config)
    unscaled = rope_inverse_frequencies(edgetrain.load_model(copy_checkpoint("plain")).config)
    assert torch.equal(frequencies["type"], frequencies["rope_type"])
    assert not torch.equal(frequencies["type"], unscaled)
