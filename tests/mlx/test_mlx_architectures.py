"""Today's architectures on MLX: a torch decoder with every Gemma 3 feature (sliding window shorter than the
sequence, soft-capped head, sandwich norms, GeGLU, scaled embeddings, head norms) and a Qwen3 one, copied to
MLX, give torch's logits, and MLX's bp and mesp give torch's loss and LoRA gradients."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install edgetrain[mlx])")
torch = pytest.importorskip("torch")

import edgetrain  # noqa: E402
from edgetrain.backends.mlx.adapters import set_adapter_weights_from_torch  # noqa: E402
from edgetrain.backends.mlx.loading import from_torch  # noqa: E402
from edgetrain.backends.mlx.lora import add_lora  # noqa: E402
from edgetrain.backends.mlx.methods import MLX_METHODS  # noqa: E402
from edgetrain.methods import METHODS  # noqa: E402
from edgetrain.models.lora import lora_state_dict  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "methods"))
from test_mesp_parity import gemma3_decoder, qwen3_decoder, random_batch  # noqa: E402


BUILDERS = {"gemma3": lambda: gemma3_decoder(9), "gemma3-uncapped": lambda: gemma3_decoder(9, None),
            "qwen3": lambda: qwen3_decoder(8)}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_mlx_gives_torchs_logits_loss_and_lora_gradients(name):
    torch_model = BUILDERS[name]()
    mlx_model = from_torch(torch_model)
    batch = random_batch(97, seq_len=11)
    inputs = mx.array(batch.inputs.numpy().astype(np.int32))
    targets = mx.array(batch.targets.numpy().astype(np.int32))
    with torch.no_grad():
        expected = torch_model(batch.inputs).numpy()
    got = np.array(mlx_model(inputs))
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()

    edgetrain.add_lora(torch_model, rank=4)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter_name, param in torch_model.named_parameters():
            if parameter_name.endswith("lora_B"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    add_lora(mlx_model, rank=4)
    set_adapter_weights_from_torch(mlx_model, lora_state_dict(torch_model))
    torch_loss, torch_grads = METHODS.get("bp")(torch_model).gradients(batch)
    for method in ("bp", "mesp"):
        loss, grads = MLX_METHODS.get(method)(mlx_model, **({"attention_chunk": 5, "mlp_chunk": 7}
                                                            if method == "mesp" else {})).gradients(inputs, targets)
        assert abs(float(loss) - float(torch_loss)) <= 1e-5 * abs(float(torch_loss)), method
        for parameter_name, torch_grad in torch_grads.items():
            head, _, part = parameter_name.rpartition(".")
            expected_grad = torch_grad.numpy().T
            got_grad = np.array(grads[f"{head}.{part.lower()}"])
            assert np.abs(got_grad - expected_grad).max() <= 1e-4 * np.abs(expected_grad).max(), (method, parameter_name)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_the_models_copy_and_pickle_on_both_frameworks(name):
    """What the learners' snapshots and the exporters do to a model (a function held by a module would not
    copy on MLX, whose silu is a compiled function)."""
    import copy
    import pickle

    torch_model = BUILDERS[name]()
    mlx_model = from_torch(torch_model)
    ids = mx.array(np.array([[1, 2, 3, 4, 5]], dtype=np.int32))
    assert np.array_equal(np.array(copy.deepcopy(mlx_model)(ids)), np.array(mlx_model(ids)))
    again = pickle.loads(pickle.dumps(torch_model))
    with torch.no_grad():
        assert torch.equal(again(torch.tensor([[1, 2, 3, 4, 5]])), torch_model(torch.tensor([[1, 2, 3, 4, 5]])))
