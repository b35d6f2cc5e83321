"""One adapter in every format: edgetrain file <-> PEFT <-> mlx-lm conversions copy the weights exactly,
the format of a path is detected, the CLI converts, and generate/eval load any of them."""
from __future__ import annotations

import json

import pytest
import torch

import edgetrain
from edgetrain.adapters.convert import convert_adapter, detect_format, load_adapter, read_adapter
from edgetrain.cli import main
from edgetrain.models.lora import AdapterError, lora_state_dict
from testkit import random_lora_b


@pytest.fixture
def adapter_file(tmp_path):
    model = edgetrain.load_model("tiny")
    edgetrain.add_lora(model, rank=4, alpha=6.0, targets=("q", "o", "up"))
    random_lora_b(model, 1, 0.1)
    return edgetrain.save_lora(model, tmp_path / "adapter.safetensors"), lora_state_dict(model)


def _same(tensors, expected):
    return tensors.keys() == expected.keys() and all(torch.equal(tensors[k].float(), expected[k].float())
                                                     for k in expected)


def test_edgetrain_to_peft_to_mlx_lm_and_back_is_exact(adapter_file, tmp_path):
    pytest.importorskip("mlx.core")
    path, expected = adapter_file
    peft_dir = convert_adapter(path, tmp_path / "peft", "peft")
    mlx_dir = convert_adapter(peft_dir, tmp_path / "mlx", "mlx-lm")
    back = convert_adapter(mlx_dir, tmp_path / "back.safetensors", "edgetrain")
    assert [detect_format(p) for p in (path, peft_dir, mlx_dir, back)] == ["edgetrain", "peft", "mlx-lm", "edgetrain"]
    for source in (path, peft_dir, mlx_dir, back):
        config, tensors = read_adapter(source)
        assert (config.rank, config.alpha, config.targets) == (4, 6.0, ("q", "o", "up")) and _same(tensors, expected)
    model = load_adapter(edgetrain.load_model("tiny"), mlx_dir)
    assert _same(lora_state_dict(model), expected)


def test_the_cli_converts_and_generate_reads_every_format(adapter_file, tmp_path, capsys):
    path, _ = adapter_file
    assert main(["export-adapter", "--adapter", str(path), "--format", "peft", "--out", str(tmp_path / "p"),
                 "--base-model", "tiny", "--quiet"]) == 0
    assert json.loads((tmp_path / "p" / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny"
    capsys.readouterr()
    outputs = []
    for adapter in (path, tmp_path / "p"):
        assert main(["generate", "--prompt", "abc", "--max-tokens", "6", "--adapter", str(adapter), "--quiet"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]


def test_unknown_paths_and_formats_are_refused(adapter_file, tmp_path):
    path, _ = adapter_file
    with pytest.raises(AdapterError, match="does not exist"):
        detect_format(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match="neither an adapter file nor an adapter directory"):
        detect_format(tmp_path / "empty")
    with pytest.raises(AdapterError, match="unknown adapter format 'onnx'"):
        convert_adapter(path, tmp_path / "x", "onnx")
    with pytest.raises(AdapterError, match="writing a GGUF adapter needs the base model"):
        convert_adapter(path, tmp_path / "x.gguf", "gguf")
    with pytest.raises(AdapterError, match="would replace the adapter being read"):
        convert_adapter(path, path, "edgetrain")
    (tmp_path / "plain.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(edgetrain.EdgetrainError):
        read_adapter(tmp_path / "plain.safetensors")


def test_load_model_takes_an_adapter_of_any_format_on_torch_and_mlx(adapter_file, tmp_path):
    path, expected = adapter_file
    peft_dir = convert_adapter(path, tmp_path / "peft", "peft")
    for source in (path, peft_dir):
        assert _same(lora_state_dict(edgetrain.load_model("tiny", adapter=source)), expected)
    mx = pytest.importorskip("mlx.core")
    import numpy as np

    from edgetrain.backends.mlx.lora import trainable_parameters

    mlx_model = edgetrain.load_model("tiny", backend="mlx", adapter=peft_dir)
    got = {name: np.array(value.astype(mx.float32)) for name, value in trainable_parameters(mlx_model).items()}
    for name, tensor in expected.items():
        head, _, part = name.rpartition(".")
        assert np.array_equal(got[f"{head}.{part.lower()}"], tensor.float().numpy().T)
    with pytest.raises(AdapterError):
        edgetrain.load_model("tiny", adapter=tmp_path / "missing")
