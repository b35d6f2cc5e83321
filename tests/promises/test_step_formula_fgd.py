"""One step equals its formula: `fgd` takes theta' = theta - lr * mean_j (grad L . v_j) v_j, each tangent v_j
drawn again from its key (run seed, sample = step, module 0, draw j, parameter index) and scaled by the
parameter's alpha. grad L comes from reverse-mode autograd here and the dot product is taken here, so the
method's forward-mode JVPs are checked against an independent derivative (float64)."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import edgetrain
from edgetrain.data.batch import Batch
from edgetrain.methods.tangents import TangentKey, draw_tangent
from float64_mlp import feature_batches, mlp_float64

# One intra-op thread (tests/conftest.py: fixed reduction order, no OpenMP spinning).
pytestmark = pytest.mark.usefixtures("one_thread")

LR = 0.05
SEED = 3
# The directional derivative dL/dv comes out of the task loss, float64 for this float64 model
# (edgetrain/training/losses.py): the update is exact to float64 rounding.
RTOL = 1e-10


def autograd_gradient(model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    loss = F.cross_entropy(model(batch.inputs), batch.targets)
    return dict(zip(params, torch.autograd.grad(loss, list(params.values()))))


def tangent(param: torch.Tensor, index: int, sample: int, draw: int, alpha: float) -> torch.Tensor:
    """The tangent of the parameter at position `index` among the trainable ones, drawn from its key
    with alpha 1 and scaled here, so the alpha scaling is checked too."""
    return alpha * draw_tangent(param, TangentKey(SEED, sample, 0, draw).parameter_seed(index))


def forward_gradient_update(model: nn.Module, batch: Batch, sample: int, num_tangents: int,
                            alphas: dict[str, float]) -> dict[str, torch.Tensor]:
    """-lr * mean_j (grad L . v_j) v_j for every parameter."""
    grad = autograd_gradient(model, batch)
    params = dict(model.named_parameters())
    update = {name: torch.zeros_like(p) for name, p in params.items()}
    for draw in range(num_tangents):
        v = {name: tangent(p.detach(), index, sample, draw, alphas[name])
             for index, (name, p) in enumerate(params.items())}
        derivative = sum(float((grad[name] * v[name]).sum()) for name in params)
        for name in params:
            update[name] -= LR * derivative / num_tangents * v[name]
    return update


@pytest.mark.parametrize("num_tangents,alpha,alphas", [
    (1, 1.0, lambda name: 1.0),
    (3, 1.0, lambda name: 1.0),
    (1, 0.5, lambda name: 0.5),
    # The longest prefix wins; 0 freezes blocks.0 (no perturbation, no update).
    (2, {"": 0.5, "blocks.0": 0.0, "head.bias": 1.0}, lambda name: 0.0 if name.startswith("blocks.0.")
     else 1.0 if name == "head.bias" else 0.5),
])
def test_fgd_step_is_theta_minus_lr_times_the_forward_gradient_along_the_seeded_tangents(
        num_tangents: int, alpha: Any, alphas: Callable[[str], float]):
    model = mlp_float64()
    learner = edgetrain.Learner(model, method="fgd", optimizer="sgd", lr=LR, probe=False,
                                method_options={"seed": SEED, "num_tangents": num_tangents, "alpha": alpha})
    scales = {name: alphas(name) for name, _ in model.named_parameters()}
    for sample, batch in enumerate(feature_batches(2)):  # the second step: sample 1's tangents
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        update = forward_gradient_update(model, batch, sample, num_tangents, scales)
        learner.step(batch)
        for name, param in model.named_parameters():
            if scales[name] == 0.0:
                assert torch.equal(param, before[name]), f"{name} has alpha 0 but changed"
                continue
            assert update[name].abs().max() > 1e-6, name
            torch.testing.assert_close(param.detach() - before[name], update[name], rtol=RTOL,
                                       atol=RTOL * float(update[name].abs().max()))


def test_fgd_through_another_optimizer_feeds_it_the_forward_gradient():
    options = {"momentum": 0.9, "weight_decay": 0.01}
    model = mlp_float64()
    learner = edgetrain.Learner(model, method="fgd", optimizer="sgd", lr=LR, probe=False, optimizer_options=options,
                                method_options={"seed": SEED, "num_tangents": 2})
    reference = {name: nn.Parameter(p.detach().clone()) for name, p in model.named_parameters()}
    reference_optimizer = torch.optim.SGD(list(reference.values()), lr=LR, **options)
    ones = {name: 1.0 for name in reference}
    for sample, batch in enumerate(feature_batches(3)):  # momentum carries the estimates over steps
        update = forward_gradient_update(model, batch, sample, 2, ones)
        before = {name: p.detach().clone() for name, p in reference.items()}
        for name, param in reference.items():
            param.grad = update[name] / -LR  # the estimate itself
        reference_optimizer.step()
        learner.step(batch)
        for name, param in model.named_parameters():
            expected = reference[name].detach() - before[name]
            torch.testing.assert_close(param.detach() - before[name], expected, rtol=RTOL,
                                       atol=RTOL * float(expected.abs().max()))
