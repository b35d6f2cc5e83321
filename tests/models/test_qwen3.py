"""Qwen3 (dense) from a checkpoint transformers saved: logits equal transformers', and every method's
LoRA gradients equal autograd's, on torch and on MLX (head norms over q and k, head_dim != hidden / heads)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import edgetrain
from testkit import move_norms_off_one
from edgetrain.methods import METHODS

transformers = pytest.importorskip("transformers")


def qwen3_checkpoint(directory, tie: bool = False):
    """A tiny random Qwen3 saved by transformers, its q/k norms and other norms away from one."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=64, tie_word_embeddings=tie, initializer_range=0.2)
    model = transformers.Qwen3ForCausalLM(config).eval()
    move_norms_off_one(model)
    model.save_pretrained(directory)
    return model


def tokens(seed: int = 0, batch: int = 2, seq: int = 19) -> torch.Tensor:
    return torch.randint(0, 97, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tie", [False, True])
def test_logits_equal_transformers(tmp_path, tie):
    reference = qwen3_checkpoint(tmp_path, tie)
    model = edgetrain.load_model(tmp_path)
    assert model.config.model_type == "qwen3" and model.config.qk_norm and model.config.head_dim == 16
    ids = tokens()
    with torch.no_grad():
        expected, got = reference(ids).logits, model(ids)
    assert float((got - expected).abs().max() / expected.abs().max()) <= 1e-5


@pytest.mark.parametrize("method", ["mesp", "mebp"])
def test_lora_gradients_equal_autograd(tmp_path, method):
    from edgetrain.data.batch import Batch

    qwen3_checkpoint(tmp_path)
    model = edgetrain.load_model(tmp_path)
    edgetrain.add_lora(model, rank=4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    ids = tokens(1, seq=20)
    batch = Batch(ids[:, :-1], ids[:, 1:])
    ref_loss, ref_grads = METHODS.get("bp")(model).gradients(batch)
    loss, grads = METHODS.get(method)(model).gradients(batch)
    assert abs(float(loss - ref_loss)) <= 1e-6 * abs(float(ref_loss))
    for name, ref in ref_grads.items():
        assert float((grads[name] - ref).abs().max() / ref.abs().max()) <= 1e-5, name


def test_mlx_loads_it_with_torchs_logits_and_mesp_gradients(tmp_path):
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install edgetrain[mlx])")
    from edgetrain.backends.mlx.adapters import set_adapter_weights_from_torch
    from edgetrain.backends.mlx.lora import add_lora
    from edgetrain.backends.mlx.methods import MLX_METHODS
    from edgetrain.data.batch import Batch
    from edgetrain.models.lora import lora_state_dict

    qwen3_checkpoint(tmp_path)
    torch_model = edgetrain.load_model(tmp_path)
    mlx_model = edgetrain.load_model(tmp_path, backend="mlx")
    ids = tokens(2, seq=20)
    with torch.no_grad():
        expected = torch_model(ids).numpy()
    got = np.array(mlx_model(mx.array(ids.numpy().astype(np.int32))))
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()

    edgetrain.add_lora(torch_model, rank=4)
    with torch.no_grad():
        for name, param in torch_model.named_parameters():
            if name.endswith("lora_B"):
                param.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    add_lora(mlx_model, rank=4)
    set_adapter_weights_from_torch(mlx_model, lora_state_dict(torch_model))
    batch = Batch(ids[:, :-1], ids[:, 1:])
    torch_loss, torch_grads = METHODS.get("bp")(torch_model).gradients(batch)
    inputs = mx.array(batch.inputs.numpy().astype(np.int32))
    targets = mx.array(batch.targets.numpy().astype(np.int32))
    for method in ("bp", "mesp"):
        loss, grads = MLX_METHODS.get(method)(mlx_model).gradients(inputs, targets)
        assert abs(float(loss) - float(torch_loss)) <= 1e-5 * abs(float(torch_loss))
        for name, torch_grad in torch_grads.items():
            head, _, part = name.rpartition(".")
            expected_grad = torch_grad.numpy().T
            got_grad = np.array(grads[f"{head}.{part.lower()}"])
            assert np.abs(got_grad - expected_grad).max() <= 1e-4 * np.abs(expected_grad).max(), (method, name)
