"""MLX methods against MLX autodiff: mesp and mebp give bp's gradients, mesp's loss trajectory is
bp's, also with a 4-bit base; the loss falls on real text."""
from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install edgetrain[mlx])")

from edgetrain.backends.mlx.loading import load_mlx_model  # noqa: E402
from edgetrain.backends.mlx.lora import add_lora, set_parameters, trainable_parameters  # noqa: E402
from edgetrain.backends.mlx.methods import MLX_METHODS  # noqa: E402
from edgetrain.backends.mlx.optim import FlatOptimizer  # noqa: E402
from edgetrain.backends.mlx.quantize import set_compute_mode  # noqa: E402

# Small chunks, so every chunked path (attention rows, MLP tokens, loss tokens and vocabulary) runs
# several chunks including a ragged last one.
SMALL_CHUNKS = dict(attention_chunk=12, mlp_chunk=20, loss_chunk=28, vocab_chunk=100)


def text_arrays(batch: int = 2, seq: int = 32, offset: int = 0) -> tuple[mx.array, mx.array]:
    from pydoc_data.topics import topics

    data = "".join(topics[k] for k in sorted(topics)).encode("utf-8")
    span = seq + 1
    ids = np.frombuffer(data[offset:offset + batch * span], dtype=np.uint8).astype(np.int32).reshape(batch, span)
    return mx.array(ids[:, :-1]), mx.array(ids[:, 1:])


def tiny_lora(rank: int = 4, seed: int = 0, quantize_bits: int | None = None):
    model = load_mlx_model("tiny", seed=seed, quantize_bits=quantize_bits)
    add_lora(model, rank=rank)
    keys = mx.random.split(mx.random.key(seed + 1), 64)
    params = trainable_parameters(model)
    set_parameters(model, {name: mx.random.normal(p.shape, key=keys[i % 64]) * 0.02
                           for i, (name, p) in enumerate(params.items()) if name.endswith("lora_b")})
    return model


def max_relative_error(estimate: dict, reference: dict) -> float:
    return max(float(mx.max(mx.abs(estimate[k] - reference[k])) / mx.max(mx.abs(reference[k]))) for k in reference)


@pytest.mark.parametrize("method, options", [("mesp", SMALL_CHUNKS), ("mesp", {}), ("mebp", {}),
                                             ("mesp", dict(SMALL_CHUNKS, store_lora_projection=True))])
def test_exact_methods_give_bp_gradients(method, options):
    model = tiny_lora()
    inputs, targets = text_arrays()
    reference_loss, reference = MLX_METHODS.get("bp")(model).gradients(inputs, targets)
    loss, grads = MLX_METHODS.get(method)(model, **options).gradients(inputs, targets)
    assert set(grads) == set(reference)
    assert abs(float(loss) - float(reference_loss)) <= 1e-5 * abs(float(reference_loss))
    assert max_relative_error(grads, reference) <= 1e-5


def test_ignored_targets_match_bp():
    model = tiny_lora()
    inputs, targets = text_arrays()
    targets = mx.where(mx.arange(targets.shape[1])[None, :] % 5 == 0, -100, targets)
    reference_loss, reference = MLX_METHODS.get("bp")(model).gradients(inputs, targets)
    loss, grads = MLX_METHODS.get("mesp")(model, **SMALL_CHUNKS).gradients(inputs, targets)
    assert abs(float(loss) - float(reference_loss)) <= 1e-5 * abs(float(reference_loss))
    assert max_relative_error(grads, reference) <= 1e-5


@pytest.mark.parametrize("compute_mode", ["dequantize", "quantized"])
def test_mesp_matches_bp_on_a_4bit_base(compute_mode):
    model = tiny_lora(quantize_bits=4)
    set_compute_mode(model, compute_mode)
    assert "scales" in dict(model.blocks[0].self_attn.q_proj.linear.items())  # really packed
    inputs, targets = text_arrays()
    reference_loss, reference = MLX_METHODS.get("bp")(model).gradients(inputs, targets)
    loss, grads = MLX_METHODS.get("mesp")(model, **SMALL_CHUNKS).gradients(inputs, targets)
    assert abs(float(loss) - float(reference_loss)) <= 1e-5 * abs(float(reference_loss))
    assert max_relative_error(grads, reference) <= 1e-5


def _trajectory(method: str, steps: int, options: dict, lr: float = 0.05) -> list[float]:
    model = tiny_lora()
    optimizer = FlatOptimizer(model, "sgd", lr)
    runner = MLX_METHODS.get(method)(model, **options)
    losses = []
    for step in range(steps):
        inputs, targets = text_arrays(batch=1, seq=24, offset=step * 25)
        losses.append(float(runner.step(inputs, targets, optimizer)))
    return losses


def test_mesp_loss_trajectory_is_bp_over_50_steps():
    reference = _trajectory("bp", 50, {})
    fused = _trajectory("mesp", 50, {"fused_update": True})
    np.testing.assert_allclose(fused, reference, rtol=1e-4)


def test_loss_falls_on_real_text():
    # The same 4 windows over and over: both exact methods must fit them.
    for method in ("bp", "mesp"):
        model = tiny_lora()
        optimizer = FlatOptimizer(model, "adam", 1e-2)
        runner = MLX_METHODS.get(method)(model)
        batches = [text_arrays(batch=2, seq=32, offset=i * 66) for i in range(4)]
        losses = [float(runner.step(*batches[i % 4], optimizer)) for i in range(24)]
        assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.3, (method, losses)
