"""One step equals its formula: `mezo` takes theta' = theta - lr * g z, z ~ N(0, I) drawn from the step's
seed, g = (L(theta + eps z) - L(theta - eps z)) / 2 eps -- in place with plain SGD, and as .grad = g z for
any other optimizer -- with the weights back at theta before the update. Computed here independently
(functional_call, a Generator seeded with the step's seed, torch's own optimizers), float64."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import edgetrain
from edgetrain.data.batch import Batch
from edgetrain.methods import METHODS
from float64_mlp import feature_batches, mlp_float64

# One intra-op thread (tests/conftest.py: fixed reduction order, no OpenMP spinning).
pytestmark = pytest.mark.usefixtures("one_thread")

EPSILON = 1e-3
OPTIONS = {"seed": 7, "epsilon": EPSILON}


def directions(params: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """z as documented: one Generator seeded with the step's seed, one N(0, I) draw per trainable
    parameter in the model's order."""
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=generator, dtype=p.dtype) for name, p in params.items()}


def loss_at(model: nn.Module, weights: dict[str, torch.Tensor], batch: Batch) -> torch.Tensor:
    # The task loss is a cross-entropy in the model's precision, float64 here (edgetrain/training/losses.py).
    return F.cross_entropy(functional_call(model, weights, (batch.inputs,)), batch.targets)


@torch.no_grad()
def projected_gradient(model: nn.Module, batch: Batch, z: dict[str, torch.Tensor]) -> float:
    theta = {name: p.detach().clone() for name, p in model.named_parameters()}
    plus = {name: torch.add(theta[name], z[name], alpha=EPSILON) for name in theta}
    # theta - eps z reached as the method walks there (+eps, then -2 eps): the loss would otherwise
    # round differently at a point 1e-17 away, and g is a difference quotient over 2e-3.
    minus = {name: torch.add(plus[name], z[name], alpha=-2 * EPSILON) for name in theta}
    return float((loss_at(model, plus, batch) - loss_at(model, minus, batch)) / (2 * EPSILON))


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_mezo_sgd_step_is_theta_minus_lr_g_z_with_z_from_the_step_seed():
    model = mlp_float64()
    learner = edgetrain.Learner(model, method="mezo", optimizer="sgd", lr=0.05, probe=False, method_options=OPTIONS)
    for batch in feature_batches(2):  # the second step draws a new z from the next step's seed
        before = weights(model)
        z = directions(before, learner.method._step_seed())
        g = projected_gradient(model, batch, z)
        assert abs(g) > 1e-3
        learner.step(batch)
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.detach(), before[name] - 0.05 * g * z[name], rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("optimizer,options", [
    ("sgd", {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("adamw", {"weight_decay": 0.1}),
])
def test_mezo_through_another_optimizer_feeds_it_g_z_as_the_gradient(optimizer: str, options: dict[str, Any]):
    model = mlp_float64()
    learner = edgetrain.Learner(model, method="mezo", optimizer=optimizer, lr=0.05, probe=False,
                                optimizer_options=options, method_options=OPTIONS)
    reference = {name: nn.Parameter(p) for name, p in weights(model).items()}
    torch_optimizer = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[optimizer]
    reference_optimizer = torch_optimizer(list(reference.values()), lr=0.05, **options)
    for batch in feature_batches(3):  # momentum / Adam moments carry g z from step to step
        z = directions(reference, learner.method._step_seed())
        g = projected_gradient(model, batch, z)
        for name, param in reference.items():
            param.grad = g * z[name]
        reference_optimizer.step()
        learner.step(batch)
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.detach(), reference[name].detach(), rtol=1e-10, atol=1e-14)
            assert param.grad is None


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam])
def test_mezo_puts_the_weights_back_at_theta_before_the_update(optimizer: type[torch.optim.Optimizer]):
    # With lr = 0 the update adds nothing: what is left is what the two perturbed forwards left, which
    # must be theta (they evaluate theta +/- eps z without writing it into the weights).
    # (The Learner refuses lr = 0, so the method is driven directly.)
    model = mlp_float64()
    before = weights(model)
    METHODS.get("mezo")(model, **OPTIONS).step(feature_batches(1)[0], optimizer(model.parameters(), lr=0.0))
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), before[name], rtol=0, atol=1e-15)
