"""Adapters in mlx-lm's format (file layout, key names, shapes, adapter_config.json), their round
trip, and conversion from/to edgetrain's torch adapter file with identical model outputs."""
from __future__ import annotations

import json

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install edgetrain[mlx])")
torch = pytest.importorskip("torch")

import edgetrain  # noqa: E402
from edgetrain.backends.mlx.adapters import (AdapterError, load_mlx_lm_adapters, mlx_lm_to_torch_adapter,  # noqa: E402
                                             save_mlx_lm_adapters, torch_adapter_to_mlx_lm)
from edgetrain.backends.mlx.loading import from_torch, load_mlx_model  # noqa: E402
from edgetrain.backends.mlx.lora import add_lora, set_parameters, trainable_parameters  # noqa: E402


def trained_looking(model):
    params = trainable_parameters(model)
    set_parameters(model, {n: mx.random.normal(p.shape, key=mx.random.key(i)) * 0.05
                           for i, (n, p) in enumerate(params.items())})
    return model


def test_mlx_lm_layout_key_names_and_config(tmp_path):
    model = trained_looking(add_lora(load_mlx_model("tiny"), rank=4, alpha=8.0))
    save_mlx_lm_adapters(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_config.json", "adapters.safetensors"]
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "lora" and config["num_layers"] == 4
    assert config["lora_parameters"] == {"rank": 4, "scale": 2.0, "dropout": 0.0, "keys": [
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]}
    weights = mx.load(str(tmp_path / "adapters.safetensors"))
    assert len(weights) == 4 * 7 * 2
    hidden, intermediate = 128, 352
    assert weights["model.layers.0.self_attn.q_proj.lora_a"].shape == (hidden, 4)  # (in, r)
    assert weights["model.layers.0.self_attn.q_proj.lora_b"].shape == (4, hidden)  # (r, out)
    assert weights["model.layers.3.mlp.down_proj.lora_a"].shape == (intermediate, 4)
    assert weights["model.layers.3.self_attn.k_proj.lora_b"].shape == (4, 64)

    fresh = load_mlx_model("tiny")
    load_mlx_lm_adapters(fresh, tmp_path)
    assert fresh.lora_config.scale == 2.0
    tokens = mx.array([[1, 2, 3, 4, 5, 6]])
    np.testing.assert_allclose(np.array(fresh(tokens)), np.array(model(tokens)), rtol=1e-6, atol=1e-6)


def test_mlx_lm_adapters_on_the_last_layers_only(tmp_path):
    model = trained_looking(add_lora(load_mlx_model("tiny"), rank=2, targets=("q", "v"), num_layers=2))
    save_mlx_lm_adapters(model, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["num_layers"] == 2 and config["lora_parameters"]["keys"] == ["self_attn.q_proj", "self_attn.v_proj"]
    assert sorted({k.split(".")[2] for k in mx.load(str(tmp_path / "adapters.safetensors"))}) == ["2", "3"]
    fresh = load_mlx_lm_adapters(load_mlx_model("tiny"), tmp_path)
    tokens = mx.array([[7, 8, 9]])
    np.testing.assert_allclose(np.array(fresh(tokens)), np.array(model(tokens)), rtol=1e-6, atol=1e-6)


def test_damaged_adapter_directories_are_refused(tmp_path):
    with pytest.raises(AdapterError, match="adapter_config.json"):
        load_mlx_lm_adapters(load_mlx_model("tiny"), tmp_path)
    model = trained_looking(add_lora(load_mlx_model("tiny"), rank=2))
    save_mlx_lm_adapters(model, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "fine_tune_type": "dora"}))
    with pytest.raises(AdapterError, match="dora"):
        load_mlx_lm_adapters(load_mlx_model("tiny"), tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "lora_parameters": {
        **config["lora_parameters"], "rank": 3}}))
    with pytest.raises(AdapterError, match="shape"):
        load_mlx_lm_adapters(load_mlx_model("tiny"), tmp_path)


def test_torch_adapter_converts_to_mlx_lm_and_back(tmp_path):
    torch.manual_seed(0)
    torch_model = edgetrain.load_model("tiny")
    mlx_model = from_torch(torch_model)
    edgetrain.add_lora(torch_model, rank=4, alpha=12.0)
    with torch.no_grad():
        for name, param in torch_model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.05)
    edgetrain.save_lora(torch_model, tmp_path / "torch_adapter.safetensors")

    torch_adapter_to_mlx_lm(tmp_path / "torch_adapter.safetensors", tmp_path / "mlx_adapter")
    load_mlx_lm_adapters(mlx_model, tmp_path / "mlx_adapter")
    tokens = [[3, 1, 4, 1, 5, 9, 2, 6]]
    with torch.no_grad():
        expected = torch_model(torch.tensor(tokens)).numpy()
    got = np.array(mlx_model(mx.array(tokens)))
    assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max()

    mlx_lm_to_torch_adapter(tmp_path / "mlx_adapter", tmp_path / "back.safetensors")
    torch.manual_seed(0)
    other = edgetrain.load_lora(edgetrain.load_model("tiny"), tmp_path / "back.safetensors")
    assert other.lora_config.rank == 4 and other.lora_config.scale == pytest.approx(3.0)
    with torch.no_grad():
        np.testing.assert_allclose(other(torch.tensor(tokens)).numpy(), expected, rtol=1e-6, atol=1e-6)


def mlx_lm_twin(model):
    """mlx-lm's own Qwen2 model holding `model`'s base weights (mlx-lm absent: the test is skipped)."""
    pytest.importorskip("mlx_lm.tuner.utils", reason="mlx-lm is not installed: the layout tests above check "
                        "its conventions; with mlx-lm present these load through mlx-lm itself")
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen2

    from edgetrain.backends.mlx.model import edgetrain_key_to_hf

    config = model.config
    args = qwen2.ModelArgs(model_type="qwen2", hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
                           intermediate_size=config.intermediate_size, num_attention_heads=config.num_attention_heads,
                           rms_norm_eps=config.rms_norm_eps, vocab_size=config.vocab_size,
                           num_key_value_heads=config.num_key_value_heads, rope_theta=config.rope_theta,
                           tie_word_embeddings=config.tie_word_embeddings)
    twin = qwen2.Model(args)
    base = [(edgetrain_key_to_hf(name), value) for name, value in tree_flatten(model.parameters())
            if ".lora_" not in name]
    twin.load_weights([(name.replace(".linear.", "."), value) for name, value in base], strict=True)
    twin.freeze()
    return twin


def test_mlx_lm_loads_an_edgetrain_adapter_and_computes_the_same_logits(tmp_path):
    from mlx.utils import tree_flatten

    model = trained_looking(add_lora(load_mlx_model("tiny", seed=5), rank=4, alpha=12.0))
    twin = mlx_lm_twin(model)
    save_mlx_lm_adapters(model, tmp_path)
    from mlx_lm.tuner.utils import load_adapters

    load_adapters(twin, str(tmp_path))
    loaded = dict(tree_flatten(twin.trainable_parameters()))
    weights = mx.load(str(tmp_path / "adapters.safetensors"))
    assert set(loaded) == set(weights)
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    expected = np.array(model(tokens))
    np.testing.assert_allclose(np.array(twin(tokens)), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("num_layers", [2, -1])
def test_an_adapter_written_by_mlx_lm_loads_in_edgetrain(tmp_path, num_layers):
    from mlx.utils import tree_flatten

    base = load_mlx_model("tiny", seed=6)
    twin = mlx_lm_twin(base)
    from mlx_lm.tuner.utils import linear_to_lora_layers

    # What mlx_lm.lora does: freeze, convert (its default config names no keys: every linear),
    # train, mx.save_safetensors(trainable parameters) and vars(args) as adapter_config.json.
    lora_parameters = {"rank": 4, "dropout": 0.0, "scale": 20.0}
    linear_to_lora_layers(twin, num_layers, lora_parameters)
    trained = {name: mx.random.normal(value.shape, key=mx.random.key(i)) * 0.02
               for i, (name, value) in enumerate(tree_flatten(twin.trainable_parameters()))}
    twin.load_weights(list(trained.items()), strict=False)
    mx.save_safetensors(str(tmp_path / "adapters.safetensors"), trained)
    (tmp_path / "adapter_config.json").write_text(json.dumps({
        "model": "local", "fine_tune_type": "lora", "num_layers": num_layers, "batch_size": 4, "iters": 10,
        "learning_rate": 1e-5, "lora_parameters": lora_parameters}))
    model = load_mlx_lm_adapters(load_mlx_model("tiny", seed=6), tmp_path)
    assert model.lora_config.rank == 4 and model.lora_config.scale == 20.0
    assert len(model.lora_config.targets) == 7
    tokens = mx.array([[2, 7, 1, 8, 2, 8, 1, 8]])
    expected = np.array(twin(tokens))
    np.testing.assert_allclose(np.array(model(tokens)), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
