"""Fault class 4, adapters: an adapter file or mlx-lm directory that does not fit the model (another alpha
or rank, tensors missing, a key naming a base weight), a damaged or hostile LoRA config, NaN values.
Each is refused with a named error before anything is written into the model: weights, adapters and
which parameters train stay exactly as they were."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import edgetrain
from edgetrain.training.checkpoint import atomic_save_safetensors
from edgetrain.models.lora import LoraConfig, lora_layers, lora_state_dict
from adapter_state import snapshot, unchanged
from fault_tally import attempt, fuzz_settings, refused

FAULT = "adapters"
FUZZ = fuzz_settings(60)


def _decoder(seed: int = 0):
    torch.manual_seed(seed)
    return edgetrain.load_model("tiny")


def _trained_adapter(path, rank: int = 4, alpha: float = 8.0, targets=("q", "v")):
    model = edgetrain.add_lora(_decoder(), rank=rank, alpha=alpha, targets=targets)
    with torch.no_grad():
        for name, param in lora_state_dict(model).items():
            param.copy_(torch.randn_like(param) * 0.05)
    edgetrain.save_lora(model, path)
    return model


def _rewrite(path, tensors=None, config=None, raw_config: str | None = None):
    """Write an adapter file with a valid checksum around hostile contents (a crafted file, not a flip)."""
    from edgetrain.training.checkpoint import load_safetensors_checked

    old_tensors, metadata = load_safetensors_checked(path)
    tensors = old_tensors if tensors is None else tensors
    if config is not None:
        raw_config = json.dumps(config)
    if raw_config is not None:
        metadata["lora_config"] = raw_config
    atomic_save_safetensors(tensors, path, metadata=metadata)


@pytest.mark.parametrize("has_adapters", [False, True], ids=["fresh-model", "model-with-adapters"])
@pytest.mark.parametrize("case", ["alpha", "rank", "targets", "missing-tensor", "extra-tensor",
                                  "base-weight-key", "nan-value", "int-tensor", "wrong-shape"])
def test_an_adapter_that_does_not_fit_is_refused_and_the_model_is_untouched(tmp_path, case, has_adapters):
    path = tmp_path / "adapter.safetensors"
    source = _trained_adapter(path)
    tensors = {k: v.clone() for k, v in lora_state_dict(source).items()}
    config = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["q", "v"]}
    first = next(iter(tensors))
    if case == "alpha":
        config["alpha"] = 16.0
    elif case == "rank":
        config["rank"] = 2
        tensors = {k: v[:2] if k.endswith("lora_A") else v[:, :2] for k, v in tensors.items()}
    elif case == "targets":
        config["targets"] = ["q", "k"]
        tensors = {k.replace("v_proj", "k_proj"): v for k, v in tensors.items()}
    elif case == "missing-tensor":
        tensors.pop(first)
    elif case == "extra-tensor":
        tensors["blocks.0.self_attn.o_proj.lora_A"] = torch.zeros(4, 64)
    elif case == "base-weight-key":
        tensors["blocks.0.self_attn.q_proj.base.weight"] = torch.zeros(64, 64)
    elif case == "nan-value":
        tensors[first][0, 0] = float("nan")
    elif case == "int-tensor":
        tensors[first] = tensors[first].to(torch.int32)
    else:
        tensors[first] = tensors[first][:, :-1]
    if case in ("alpha", "rank", "targets") and not has_adapters:
        pytest.skip("a model without adapters takes the file's config")
    _rewrite(path, tensors=tensors, config=config)
    model = _decoder()
    if has_adapters:
        edgetrain.add_lora(model, rank=4, alpha=8.0, targets=("q", "v"))
    before = snapshot(model)
    refused(FAULT, lambda: edgetrain.load_lora(model, path), match=str(path))
    assert unchanged(model, before)


@FUZZ
@given(raw=st.one_of(
    st.text(max_size=40),
    st.just("[" * 100_000 + "]" * 100_000),
    st.sampled_from(['{"rank": NaN}', '{"alpha": Infinity}', '{"alpha": 1e999}', '{"rank": 4, "alpha": -1}',
                     '{"rank": "4"}', '{"rank": 4.5}', '{"rank": true}', '{"rank": 0}', '{"rank": 1e9}',
                     '{"targets": "q"}', '{"targets": [{}]}', '{"targets": [1]}', '{"targets": []}',
                     '{"targets": ["q", "q"]}', '{"dropout": 2}', '{"dropout": "0.1"}', '{"scale": 2}',
                     '[]', '"lora"', 'null']),
    st.dictionaries(st.sampled_from(["rank", "alpha", "dropout", "targets", "other"]),
                    st.one_of(st.integers(-3, 1 << 20), st.floats(allow_nan=False, allow_infinity=False),
                              st.text(max_size=3), st.none(), st.booleans(),
                              st.lists(st.sampled_from(["q", "k", "v", "x", 3]), max_size=3)),
                    max_size=4).map(json.dumps)))
def test_a_hostile_lora_config_is_refused_or_taken_exactly(tmp_path, raw):
    path = tmp_path / "adapter.safetensors"
    _trained_adapter(path)
    _rewrite(path, raw_config=raw)
    model = _decoder()
    before = snapshot(model)

    def as_written(loaded) -> bool:
        # Accepted only when the config is the one the tensors were trained with, read exactly.
        config = loaded.lora_config
        return (config == LoraConfig(rank=4, alpha=8.0, targets=("q", "v"), dropout=config.dropout)
                and json.loads(raw).get("alpha") == 8.0)

    outcome = attempt(FAULT, lambda: edgetrain.load_lora(model, path), sound=as_written)
    if isinstance(outcome, edgetrain.EdgetrainError):
        assert unchanged(model, before)


def test_a_good_adapter_still_loads_into_a_fresh_model_and_one_with_the_same_adapters(tmp_path):
    path = tmp_path / "adapter.safetensors"
    source = _trained_adapter(path)
    tokens = torch.arange(12).view(2, 6)
    for model in (_decoder(), edgetrain.add_lora(_decoder(), rank=4, alpha=8.0, targets=("q", "v"))):
        attempt(FAULT, lambda: edgetrain.load_lora(model, path),
                sound=lambda loaded: torch.equal(loaded(tokens), source(tokens)))


def test_export_with_a_bad_adapter_says_what_is_wrong_without_a_traceback(tmp_path):
    path = tmp_path / "adapter.safetensors"
    _trained_adapter(path)
    _rewrite(path, raw_config='{"rank": 4, "alpha": "eight"}')
    result = subprocess.run([sys.executable, "-m", "edgetrain.cli", "export", "--model", "tiny", "--adapter",
                             str(path), "--out", str(tmp_path / "out.pte")], capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "alpha" in result.stderr and str(path) in result.stderr
    assert not (tmp_path / "out.pte").exists()


# -- mlx-lm adapter directories -----------------------------------------------------------------------

def _mlx_lm_directory(tmp_path):
    pytest.importorskip("mlx.core")
    from edgetrain.backends.mlx.adapters import torch_adapter_to_mlx_lm

    torch_file = tmp_path / "adapter.safetensors"
    _trained_adapter(torch_file)
    return torch_adapter_to_mlx_lm(torch_file, tmp_path / "mlx-lm")


def _mlx_model(with_adapters: bool):
    from edgetrain.backends.mlx.loading import load_mlx_model
    from edgetrain.backends.mlx.lora import add_lora

    model = load_mlx_model("tiny")
    if with_adapters:
        add_lora(model, LoraConfig(rank=4, alpha=8.0, targets=("q", "v")))
    return model


def _mlx_snapshot(model):
    import numpy as np
    from mlx.utils import tree_flatten

    from edgetrain.backends.mlx.lora import lora_layers

    return ({k: np.array(v) for k, v in tree_flatten(model.parameters())},
            sorted(k for k, _ in tree_flatten(model.trainable_parameters())), len(lora_layers(model)))


def _mlx_unchanged(model, snapshot) -> bool:
    import numpy as np

    params, trainable, adapters = _mlx_snapshot(model)
    return (params.keys() == snapshot[0].keys() and all(np.array_equal(params[k], snapshot[0][k]) for k in params)
            and trainable == snapshot[1] and adapters == snapshot[2])


@pytest.mark.parametrize("edit", [
    {"lora_parameters": {"rank": 4, "scale": 2.0, "keys": {"self_attn.q_proj": 1}}},
    {"lora_parameters": {"rank": 4, "scale": 2.0, "keys": [1, 2]}},
    {"lora_parameters": {"rank": 4, "scale": 2.0, "keys": [{"a": 1}]}},
    {"lora_parameters": {"rank": 4, "scale": 2.0, "keys": "self_attn.q_proj"}},
    {"lora_parameters": {"rank": 4, "scale": "2.0"}},
    {"lora_parameters": {"rank": 4, "scale": -2.0}},
    {"lora_parameters": {"rank": 4, "scale": 0}},
    {"lora_parameters": {"rank": 4.5, "scale": 2.0}},
    {"lora_parameters": {"rank": True, "scale": 2.0}},
    {"lora_parameters": {"rank": 4, "scale": 2.0, "dropout": 1.5}},
    {"lora_parameters": [4, 2.0]},
    {"num_layers": 2.7}, {"num_layers": "2"}, {"num_layers": None}, {"num_layers": 99},
    {"fine_tune_type": "dora"}])
def test_a_hostile_mlx_lm_config_is_refused(tmp_path, edit):
    directory = _mlx_lm_directory(tmp_path)
    config = json.loads((directory / "adapter_config.json").read_text())
    config.update(edit)
    (directory / "adapter_config.json").write_text(json.dumps(config))
    from edgetrain.backends.mlx.adapters import load_mlx_lm_adapters

    model = _mlx_model(with_adapters=False)
    before = _mlx_snapshot(model)
    refused(FAULT, lambda: load_mlx_lm_adapters(model, directory), match=str(directory))
    assert _mlx_unchanged(model, before)


@pytest.mark.parametrize("text", ["NaN", "Infinity", "1e999"])
def test_an_mlx_lm_scale_that_is_not_finite_is_refused(tmp_path, text):
    directory = _mlx_lm_directory(tmp_path)
    raw = (directory / "adapter_config.json").read_text()
    scale = json.loads(raw)["lora_parameters"]["scale"]
    (directory / "adapter_config.json").write_text(raw.replace(f'"scale": {scale}', f'"scale": {text}'))
    from edgetrain.backends.mlx.adapters import load_mlx_lm_adapters

    model = _mlx_model(with_adapters=False)
    refused(FAULT, lambda: load_mlx_lm_adapters(model, directory), match="adapter_config.json")


@pytest.mark.parametrize("has_adapters", [False, True], ids=["fresh-model", "model-with-adapters"])
@pytest.mark.parametrize("case", ["scale", "missing-tensor", "nan-value", "wrong-shape"])
def test_mlx_lm_weights_that_do_not_fit_are_refused_and_the_model_is_untouched(tmp_path, case, has_adapters):
    import mlx.core as mx

    directory = _mlx_lm_directory(tmp_path)
    from edgetrain.backends.mlx.adapters import load_mlx_lm_adapters

    weights = dict(mx.load(str(directory / "adapters.safetensors")))
    first = sorted(weights)[0]
    if case == "scale":
        if not has_adapters:
            pytest.skip("a model without adapters takes the directory's scale")
        config = json.loads((directory / "adapter_config.json").read_text())
        config["lora_parameters"]["scale"] = 4.0
        (directory / "adapter_config.json").write_text(json.dumps(config))
    elif case == "missing-tensor":
        weights.pop(first)
    elif case == "nan-value":
        weights[first] = mx.full(weights[first].shape, float("nan"))
    else:
        weights[first] = weights[first][:-1]
    mx.save_safetensors(str(directory / "adapters.safetensors"), weights)
    model = _mlx_model(has_adapters)
    before = _mlx_snapshot(model)
    refused(FAULT, lambda: load_mlx_lm_adapters(model, directory), match=str(directory))
    assert _mlx_unchanged(model, before)
