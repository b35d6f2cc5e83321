"""One step equals its formula on MLX: `edgetrain.Learner(model, backend="mlx", ...).step(batch)` moves
the LoRA weights by exactly the documented update.

  bp, mebp, mesp (plain and fused)  theta' = theta - lr * dL/dtheta, plain SGD
  mesp                              its hand-derived LoRA gradients are autograd's, at alpha / rank != 2
  mezo                              theta' = theta - lr * g z, z ~ N(0, I) from a key per parameter split
                                    off the step's key, g = (L(theta + eps z) - L(theta - eps z)) / 2 eps,
                                    the weights back at theta before the update; any other optimizer is
                                    fed g z as the gradient

The references are computed here: the loss with mlx.nn.losses.cross_entropy (not edgetrain's lm_loss),
gradients with mx.grad, z and g by hand, momentum / AdamW by mlx.optimizers fed by hand.

Precision: MLX has no float64 for every op on the CPU, so everything is float32 and the tolerances are
the float32 error of two correct computations, each stated where it is used. The bugs these tests
guard against (wrong lr, sign, gradient, LoRA scale, z or seed, weights left at theta + eps z, a
one-sided difference) move the weights 10x to 1e5x further from the formula than those tolerances.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install edgetrain[mlx])")

import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
from mlx.utils import tree_flatten, tree_unflatten  # noqa: E402

import edgetrain  # noqa: E402
from edgetrain.backends.mlx.loading import load_mlx_model  # noqa: E402
from edgetrain.backends.mlx.lora import add_lora  # noqa: E402
from edgetrain.data.batch import Batch  # noqa: E402
from edgetrain.methods.base import TrainingError  # noqa: E402

# scale = alpha / rank = 3.25: a hand-derived backward that drops or hard-codes the LoRA scale (the
# default alpha 16 / rank 8 is 2) gets the gradient wrong.
RANK, ALPHA = 4, 13.0
EPSILON = 1e-2
# Not the default seed 0 (a method that ignored the option would pass); with these batches it gives
# |g| >= 1.4 at every step, far above g's float32 noise (MEZO_RTOL).
MEZO_SEED = 9
# Two correct float32 gradient computations (different op order: autograd, checkpointed, hand-derived)
# agree to ~1e-6 of the largest entry (the parity tests allow 1e-5); a wrong gradient is off by O(1).
EXACT_RTOL = 1e-5
# g is a difference of two float32 losses (~5.5, ulp 4.8e-7) over 2 eps = 2e-2: 8 ulps of loss
# difference move g by 2e-4, under 4e-4 of |g| (asserted > 0.5). A one-sided difference is off by ~8%
# here, a wrong z, seed or sign by O(1), weights left at theta + eps z by eps / (lr g) ~ 7x the update.
MEZO_RTOL = 5e-3


def lora_model() -> nn.Module:
    """The tiny MLX decoder with LoRA (base frozen); lora_b made non-zero so that lora_a has a gradient."""
    model = load_mlx_model("tiny", seed=0)
    add_lora(model, rank=RANK, alpha=ALPHA)
    params = trainable(model)
    keys = mx.random.split(mx.random.key(1), len(params))
    model.update(tree_unflatten([(name, mx.random.normal(p.shape, key=keys[i]) * 0.05)
                                 for i, (name, p) in enumerate(params.items()) if name.endswith("lora_b")]))
    mx.eval(model.parameters())
    return model


def token_batches(count: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for index in range(count):
        ids = torch.randint(0, 256, (2, 17), generator=generator)
        batches.append(Batch(ids[:, :-1], ids[:, 1:], index))
    return batches


def trainable(model: nn.Module) -> dict[str, mx.array]:
    return dict(tree_flatten(model.trainable_parameters()))


def frozen(model: nn.Module) -> dict[str, np.ndarray]:
    names = set(trainable(model))
    return {name: np.array(p) for name, p in tree_flatten(model.parameters()) if name not in names}


def loss_at(model: nn.Module, weights: dict[str, mx.array], batch: Batch) -> mx.array:
    """Mean next-token cross-entropy with the trainable weights set to `weights`; the model keeps its own."""
    kept = trainable(model)
    model.update(tree_unflatten(list(weights.items())))
    try:
        logits = model(mx.array(batch.inputs.numpy().astype(np.int32)))
        return nn.losses.cross_entropy(logits, mx.array(batch.targets.numpy().astype(np.int32)), reduction="mean")
    finally:
        model.update(tree_unflatten(list(kept.items())))


def autograd_gradient(model: nn.Module, batch: Batch) -> dict[str, mx.array]:
    grads = mx.grad(lambda weights: loss_at(model, weights, batch))(trainable(model))
    mx.eval(grads)
    return grads


def step_seed(step: int) -> int:
    """The documented per-step seed of mezo: keyed by (seed, step)."""
    return (MEZO_SEED * 1_000_003 + step) % (2**63 - 1)


def directions(weights: dict[str, mx.array], seed: int) -> dict[str, mx.array]:
    """z as documented: the step's key split into one key per trainable parameter (the model's order),
    one N(0, I) draw from each."""
    keys = mx.random.split(mx.random.key(seed), len(weights))
    return {name: mx.random.normal(p.shape, dtype=p.dtype, key=keys[i]) for i, (name, p) in enumerate(weights.items())}


def projected_gradient(model: nn.Module, batch: Batch, z: dict[str, mx.array]) -> float:
    theta = trainable(model)
    plus = {name: theta[name] + EPSILON * z[name] for name in theta}
    # theta - eps z reached as the method walks there (+eps, then -2 eps): a point one rounding away
    # would give a float32 loss a few ulps off, and g divides by 2 eps.
    minus = {name: plus[name] - 2 * EPSILON * z[name] for name in theta}
    return float((loss_at(model, plus, batch) - loss_at(model, minus, batch)) / (2 * EPSILON))


def assert_moved_by(after: dict[str, mx.array], before: dict[str, mx.array], delta: dict[str, mx.array],
                    rtol: float) -> None:
    """after == before + delta per parameter, within rtol of the largest |delta| plus 8 float32 ulps of
    the largest weight (the rounding of before + delta itself)."""
    assert set(after) == set(before) == set(delta)
    for name in before:
        expected = np.array(before[name] + delta[name])
        error = float(np.max(np.abs(np.array(after[name]) - expected)))
        bound = rtol * float(np.max(np.abs(np.array(delta[name])))) + 2.0**-20 * float(np.max(np.abs(expected)))
        assert error <= bound, f"{name}: off the formula by {error:.3g}, allowed {bound:.3g}"


@pytest.mark.parametrize("method,options", [("bp", {}), ("mebp", {}), ("mesp", {}),
                                            ("mesp", {"fused_update": True})])
def test_exact_methods_sgd_step_is_theta_minus_lr_grad(method: str, options: dict[str, Any]):
    model = lora_model()
    base = frozen(model)
    lr = 0.1
    learner = edgetrain.Learner(model, backend="mlx", method=method, optimizer="sgd", lr=lr, probe=False,
                                method_options=options)
    for batch in token_batches(2):  # the second step from the first one's weights
        before = trainable(model)
        grads = autograd_gradient(model, batch)
        learner.step(batch)
        assert_moved_by(trainable(model), before, {n: -lr * g for n, g in grads.items()}, EXACT_RTOL)
    for name, value in frozen(model).items():  # the frozen base takes no update
        np.testing.assert_array_equal(value, base[name], err_msg=name)


def test_mesp_lora_gradients_are_autograds_at_rank_4_alpha_13():
    model = lora_model()
    batch = token_batches(1)[0]
    reference = autograd_gradient(model, batch)
    _, grads = edgetrain.Learner(model, backend="mlx", method="mesp", probe=False).compute_gradients(batch)
    assert set(grads) == set(reference)
    for name, expected in reference.items():
        error = float(mx.max(mx.abs(grads[name] - expected)))
        scale = float(mx.max(mx.abs(expected)))
        assert scale > 0 and error <= EXACT_RTOL * scale, f"{name}: {error:.3g} off, largest entry {scale:.3g}"


def test_mezo_sgd_step_is_theta_minus_lr_g_z_with_z_from_the_step_seed():
    model = lora_model()
    lr = 1e-3  # lr * |g| < eps: weights left at theta + eps z would be off by more than the update itself
    learner = edgetrain.Learner(model, backend="mlx", method="mezo", optimizer="sgd", lr=lr, probe=False,
                                method_options={"seed": MEZO_SEED, "epsilon": EPSILON})
    for step, batch in enumerate(token_batches(2)):  # the second step draws a new z from the next seed
        before = trainable(model)
        z = directions(before, step_seed(step))
        g = projected_gradient(model, batch, z)
        assert abs(g) > 0.5
        learner.step(batch)
        assert_moved_by(trainable(model), before, {n: -lr * g * z[n] for n in before}, MEZO_RTOL)


@pytest.mark.parametrize("optimizer,options", [
    ("sgd", {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("adamw", {"weight_decay": 0.1}),
])
def test_mezo_through_another_optimizer_feeds_it_g_z_as_the_gradient(optimizer: str, options: dict[str, Any]):
    model = lora_model()
    lr = 1e-3
    learner = edgetrain.Learner(model, backend="mlx", method="mezo", optimizer=optimizer, lr=lr, probe=False,
                                optimizer_options=options, method_options={"seed": MEZO_SEED, "epsilon": EPSILON})
    reference = {"sgd": optim.SGD, "adamw": optim.AdamW}[optimizer](learning_rate=lr, **options)
    for step, batch in enumerate(token_batches(3)):  # momentum / Adam moments carry g z from step to step
        before = trainable(model)
        z = directions(before, step_seed(step))
        g = projected_gradient(model, batch, z)
        expected = reference.apply_gradients({n: g * z[n] for n in before}, before)
        learner.step(batch)
        assert_moved_by(trainable(model), before, {n: expected[n] - before[n] for n in before}, MEZO_RTOL)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_mezo_puts_the_weights_back_at_theta_before_the_update(optimizer: str):
    # With lr = 0 the update adds nothing: what is left is what the +eps / -2 eps / +eps walk left,
    # theta up to a few float32 roundings (~1e-8 here), where a missing step back leaves eps z ~ 1e-2.
    model = lora_model()
    before = trainable(model)
    learner = edgetrain.Learner(model, backend="mlx", method="mezo", optimizer=optimizer, lr=0.0, probe=False,
                                method_options={"seed": MEZO_SEED, "epsilon": EPSILON})
    learner.step(token_batches(1)[0])
    assert_moved_by(trainable(model), before, {n: mx.zeros_like(p) for n, p in before.items()}, 0.0)


def test_non_finite_gradient_part_way_through_a_fused_step_keeps_the_last_good_weights_and_adam_state():
    # Fused mesp updates blocks 3, 2, 1 before it reaches block 0. A NaN put into block 0's gradient
    # (poisoning a weight instead would make the loss, and so block 3's gradient, NaN: nothing would
    # be updated yet) is refused there; the three updates already made must be undone, moments too.
    model = lora_model()
    learner = edgetrain.Learner(model, backend="mlx", method="mesp", optimizer="adam", lr=1e-2, probe=False,
                                method_options={"fused_update": True})
    good, bad = token_batches(2)
    learner.step(good)
    weights = {name: np.array(p) for name, p in trainable(model).items()}
    state = {name: np.array(v) for name, v in tree_flatten(learner.optimizer.optimizer.state)}
    apply = learner.optimizer.apply

    def apply_with_nan_in_block_0(grads: dict[str, mx.array], advance_step: bool = True) -> None:
        if any(name.startswith("blocks.0.") for name in grads):
            grads = {name: g * mx.nan for name, g in grads.items()}
        apply(grads, advance_step)

    learner.optimizer.apply = apply_with_nan_in_block_0
    with pytest.raises(TrainingError, match="last good step"):
        learner.step(bad)
    assert learner.steps_done == 1
    for name, value in trainable(model).items():
        np.testing.assert_array_equal(np.array(value), weights[name], err_msg=name)
    restored = dict(tree_flatten(learner.optimizer.optimizer.state))
    assert set(restored) == set(state)
    for name, value in restored.items():
        np.testing.assert_array_equal(np.array(value), state[name], err_msg=name)
