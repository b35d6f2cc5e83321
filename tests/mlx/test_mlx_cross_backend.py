"""The same checkpoint and LoRA init give the same loss and LoRA gradients on torch and MLX, and an
MLX decoder loads Hugging Face checkpoint directories with the torch loader's checks."""
from __future__ import annotations

import json

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install edgetrain[mlx])")
torch = pytest.importorskip("torch")

import edgetrain  # noqa: E402
from edgetrain.backends.mlx.adapters import set_adapter_weights_from_torch  # noqa: E402
from edgetrain.backends.mlx.loading import from_torch, load_mlx_model  # noqa: E402
from edgetrain.backends.mlx.lora import add_lora  # noqa: E402
from edgetrain.backends.mlx.methods import MLX_METHODS, lm_loss  # noqa: E402
from edgetrain.data.batch import Batch  # noqa: E402
from edgetrain.methods import METHODS  # noqa: E402
from edgetrain.models.hf_checkpoint import CheckpointError  # noqa: E402
from edgetrain.models.llama import ConfigError, edgetrain_key_to_hf  # noqa: E402
from edgetrain.models.lora import lora_state_dict  # noqa: E402


def torch_batch(batch: int = 2, seq: int = 32) -> Batch:
    from pydoc_data.topics import topics

    data = "".join(topics[k] for k in sorted(topics)).encode("utf-8")
    ids = torch.tensor(list(data[:batch * (seq + 1)]), dtype=torch.long).view(batch, seq + 1)
    return Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), 0)


def twin_models(rank: int = 4, source: str = "copy", directory=None):
    """A torch and an MLX decoder with the same weights and the same LoRA init: the MLX one copied
    from the torch one ("copy"), or both loaded from one Hugging Face checkpoint directory
    ("checkpoint", through edgetrain.load_model with backend="torch" and backend="mlx")."""
    torch.manual_seed(0)
    torch_model = edgetrain.load_model("tiny")
    if source == "checkpoint":
        write_hf_checkpoint(torch_model, directory)
        torch_model = edgetrain.load_model(directory)
        mlx_model = edgetrain.load_model(directory, backend="mlx")
    else:
        mlx_model = from_torch(torch_model)
    edgetrain.add_lora(torch_model, rank=rank)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in torch_model.named_parameters():
            if name.endswith("lora_B"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    add_lora(mlx_model, rank=rank)
    set_adapter_weights_from_torch(mlx_model, lora_state_dict(torch_model))
    return torch_model, mlx_model


def mlx_name(torch_name: str) -> str:
    head, _, part = torch_name.rpartition(".")
    return f"{head}.{part.lower()}"


@pytest.mark.parametrize("torch_method, mlx_method, source", [("bp", "bp", "copy"), ("bp", "mesp", "copy"),
                                                              ("mesp", "mesp", "checkpoint"),
                                                              ("bp", "mebp", "checkpoint")])
def test_torch_and_mlx_agree_on_loss_and_lora_gradients(torch_method, mlx_method, source, tmp_path):
    torch_model, mlx_model = twin_models(source=source, directory=tmp_path)
    batch = torch_batch()
    torch_loss, torch_grads = METHODS.get(torch_method)(torch_model).gradients(batch)
    inputs, targets = mx.array(batch.inputs.numpy().astype(np.int32)), mx.array(batch.targets.numpy().astype(np.int32))
    loss, grads = MLX_METHODS.get(mlx_method)(mlx_model).gradients(inputs, targets)
    assert abs(float(loss) - float(torch_loss)) <= 1e-4 * abs(float(torch_loss))
    assert len(grads) == len(torch_grads)
    for name, torch_grad in torch_grads.items():
        expected = torch_grad.numpy().T  # torch A [r, in] / B [out, r]; MLX lora_a [in, r] / lora_b [r, out]
        got = np.array(grads[mlx_name(name)])
        assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max(), name


def write_hf_checkpoint(torch_model, directory, model_type: str = "qwen2") -> None:
    from safetensors.torch import save_file

    config = torch_model.config
    raw = {k: v for k, v in vars(config).items() if k not in ("attention_bias",)}
    raw["model_type"] = model_type
    (directory / "config.json").write_text(json.dumps(raw))
    state = {edgetrain_key_to_hf(k): v.contiguous() for k, v in torch_model.state_dict().items()
             if k != "head.lm_head.weight"}
    save_file(state, str(directory / "model.safetensors"))


def test_hf_checkpoint_directory_loads_with_the_torch_models_numbers(tmp_path):
    torch.manual_seed(3)
    torch_model = edgetrain.load_model("tiny")
    write_hf_checkpoint(torch_model, tmp_path)
    mlx_model = load_mlx_model(tmp_path)
    reloaded = edgetrain.load_model(tmp_path)
    batch = torch_batch(1, 16)
    with torch.no_grad():
        expected = reloaded(batch.inputs).numpy()
    got = np.array(mlx_model(mx.array(batch.inputs.numpy().astype(np.int32))))
    assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max()
    loss = lm_loss(mx.array(got), mx.array(batch.targets.numpy().astype(np.int32)))
    assert np.isfinite(float(loss))


def test_damaged_checkpoints_are_refused_with_the_torch_loaders_errors(tmp_path):
    torch.manual_seed(3)
    torch_model = edgetrain.load_model("tiny")
    write_hf_checkpoint(torch_model, tmp_path)
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.0.mlp.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensor"):
        load_mlx_model(tmp_path)
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="shape"):
        load_mlx_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64}))
    with pytest.raises(ConfigError, match="lacks required"):
        load_mlx_model(tmp_path)
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        load_mlx_model(tmp_path / "absent")
