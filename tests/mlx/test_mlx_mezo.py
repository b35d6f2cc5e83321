"""MLX mezo: seed-regenerated perturbations, a finite difference that is the directional derivative,
estimates whose mean points along the true gradient."""
from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install edgetrain[mlx])")

from edgetrain.backends.mlx.loading import load_mlx_model  # noqa: E402
from edgetrain.backends.mlx.lora import add_lora, set_parameters, trainable_parameters  # noqa: E402
from edgetrain.backends.mlx.methods import MLX_METHODS  # noqa: E402
from edgetrain.backends.mlx.optim import FlatOptimizer  # noqa: E402


def small_lora_model():
    # Few trainable numbers (rank 1 on q and v), so that a few hundred estimates can average out.
    model = load_mlx_model("tiny", seed=0)
    add_lora(model, rank=1, targets=("q", "v"))
    params = trainable_parameters(model)
    set_parameters(model, {n: mx.random.normal(p.shape, key=mx.random.key(i)) * 0.05
                           for i, (n, p) in enumerate(params.items()) if n.endswith("lora_b")})
    return model


def arrays(seq: int = 16):
    from pydoc_data.topics import topics

    data = "".join(topics[k] for k in sorted(topics)).encode("utf-8")[:seq + 1]
    ids = np.frombuffer(data, dtype=np.uint8).astype(np.int32)[None]
    return mx.array(ids[:, :-1]), mx.array(ids[:, 1:])


def flat(grads: dict, names: list[str]) -> np.ndarray:
    return np.concatenate([np.array(grads[n], dtype=np.float64).ravel() for n in names])


def test_mezo_estimates_average_to_the_true_gradient_and_are_seeded():
    model = small_lora_model()
    inputs, targets = arrays()
    _, exact = MLX_METHODS.get("bp")(model).gradients(inputs, targets)
    names = sorted(exact)
    true = flat(exact, names)
    mezo = MLX_METHODS.get("mezo")(model, epsilon=1e-2, seed=7)
    before = {n: np.array(p) for n, p in trainable_parameters(model).items()}
    total = np.zeros_like(true)
    count = 100
    for step in range(count):
        mezo.steps_taken = step
        _, estimate = mezo.gradients(inputs, targets)
        total += flat(estimate, names)
    mean = total / count
    cosine = mean @ true / (np.linalg.norm(mean) * np.linalg.norm(true))
    # E[z z^T g] = g; with d trainable numbers the mean of N estimates has cosine ~ sqrt(N / (N + d)).
    dimension = true.size
    assert cosine > 0.5 * np.sqrt(count / (count + dimension)), (cosine, dimension)
    for name, value in trainable_parameters(model).items():  # gradients() leaves the weights alone
        np.testing.assert_array_equal(np.array(value), before[name])
    mezo.steps_taken = 5
    _, again_a = mezo.gradients(inputs, targets)
    _, again_b = mezo.gradients(inputs, targets)
    np.testing.assert_array_equal(flat(again_a, names), flat(again_b, names))


def test_projected_gradient_is_the_directional_derivative():
    model = small_lora_model()
    inputs, targets = arrays()
    _, exact = MLX_METHODS.get("bp")(model).gradients(inputs, targets)
    mezo = MLX_METHODS.get("mezo")(model, epsilon=1e-3, seed=3)
    for seed in (0, 1, 2):
        _, projected = mezo.projected_gradient(inputs, targets, seed)
        directional = sum(float(mx.sum(z * exact[name])) for name, z in mezo._directions(seed))
        assert abs(projected - directional) <= 2e-2 * abs(directional) + 1e-4


def test_mezo_sgd_step_moves_along_minus_projected_z():
    model = small_lora_model()
    inputs, targets = arrays()
    mezo = MLX_METHODS.get("mezo")(model, epsilon=1e-3, seed=1)
    optimizer = FlatOptimizer(model, "sgd", 1e-2)
    before = trainable_parameters(model)
    seed = mezo._step_seed()
    _, projected = mezo.projected_gradient(inputs, targets, seed)
    mezo.step(inputs, targets, optimizer)
    after = trainable_parameters(model)
    for name, z in mezo._directions(seed):
        np.testing.assert_allclose(np.array(after[name]), np.array(before[name] - 1e-2 * projected * z), atol=1e-6)
    assert mezo.state_dict() == {"seed": 1, "steps_taken": 1}
