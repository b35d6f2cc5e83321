"""One step equals its formula: in `asyncfgd` with K = 2 modules (reference runtime), the update at step t
uses the sample that entered K-1 steps earlier; its loss and directional derivative are those of the
weights its modules used when it passed through them (module 0 one update older than module 1), along
the tangents keyed (seed, that sample, module, draw). No update while the pipeline fills.

Written out here for the first K+1 steps, with grad L by reverse-mode autograd on a model that holds
the stale module-0 weights and the current module-1 weights, and the dot product taken here (float64)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import edgetrain
from edgetrain.data.batch import Batch
from edgetrain.methods.tangents import TangentKey, draw_tangent
from float64_mlp import feature_batches
import float64_mlp

# One intra-op thread (tests/conftest.py: fixed reduction order, no OpenMP spinning).
pytestmark = pytest.mark.usefixtures("one_thread")

LR = 0.1
SEED = 5
K = 2
# dL/dv leaves the task loss (edgetrain/training/losses.py) as a float64 number for this float64 model.
RTOL = 1e-10


def mlp_float64() -> nn.Module:
    return float64_mlp.mlp_float64((6, 5, 7, 6))


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def stale_update(model: nn.Module, used: dict[str, torch.Tensor], batch: Batch, sample: int,
                 module_of: dict[str, int]) -> dict[str, torch.Tensor]:
    """-lr (grad L(used) . v) v for the sample that entered at step `sample`, L evaluated at the weights
    `used` (each module's weights as they were when the sample passed through it)."""
    weights = {name: w.clone().requires_grad_(True) for name, w in used.items()}
    loss = F.cross_entropy(functional_call(model, weights, (batch.inputs,)), batch.targets)
    grads = dict(zip(weights, torch.autograd.grad(loss, list(weights.values()))))
    tangents = {name: draw_tangent(w, TangentKey(SEED, sample, module_of[name], 0).parameter_seed(index))
                for index, (name, w) in enumerate(used.items())}
    derivative = sum(float((grads[name] * tangents[name]).sum()) for name in used)
    return {name: -LR * derivative * tangents[name] for name in used}


def test_asyncfgd_updates_each_module_with_the_stale_weights_and_sample_that_entered_k_minus_1_steps_earlier():
    model = mlp_float64()
    learner = edgetrain.Learner(model, method="asyncfgd", optimizer="sgd", lr=LR, probe=False,
                                method_options={"num_modules": K, "runtime": "reference", "seed": SEED})
    module_of = {name: stage.index for stage in learner.method.stages for name in stage.params}
    assert set(module_of.values()) == {0, 1} and set(module_of) == set(snapshot(model))
    batches = feature_batches(K + 1)
    w0 = snapshot(model)

    learner.step(batches[0])  # t = 0: sample 0 is in module 0; nothing leaves, nothing updates
    for name, param in model.named_parameters():
        assert torch.equal(param, w0[name]), name

    learner.step(batches[1])  # t = 1: sample 0 leaves; both modules ran it with w0
    update = stale_update(model, w0, batches[0], 0, module_of)
    w1 = snapshot(model)
    for name in w0:
        torch.testing.assert_close(w1[name] - w0[name], update[name], rtol=RTOL,
                                   atol=RTOL * float(update[name].abs().max()))

    learner.step(batches[2])  # t = 2: sample 1 leaves; module 0 ran it at t = 1 (w0), module 1 at t = 2 (w1)
    used = {name: (w0 if module_of[name] == 0 else w1)[name] for name in w0}
    update = stale_update(model, used, batches[1], 1, module_of)
    # Sanity: the staleness matters here, so a method using the current module-0 weights would fail.
    current = stale_update(model, w1, batches[1], 1, module_of)
    assert max(float((update[n] - current[n]).abs().max() / update[n].abs().max()) for n in w0) > 1e-3
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach() - w1[name], update[name], rtol=RTOL,
                                   atol=RTOL * float(update[name].abs().max()))
