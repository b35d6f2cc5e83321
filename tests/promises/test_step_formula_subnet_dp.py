"""One step equals its formula: a `subnet_dp` step (N workers simulated in one process) cuts the batch into N
equal shards, worker i computes the gradient of its shard's loss through its subnetwork theta_i = m_i * theta
(m_i its ownership mask), and every parameter entry moves by -lr * (sum of its owners' gradients) / (its
number of owners): P for masked entries, N for the replicated trunk. A worker's data never reaches an
entry it does not own.

Per-worker gradients are computed here from the plan's masks alone: under block masking, zeroing a
residual branch's weights is exactly dropping the block (relu(0 + shortcut(h))), so the plain model run
on m_i * theta is worker i's subnetwork. Float64, SGD."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import edgetrain
from edgetrain.data.batch import Batch
from edgetrain.models.resnet_subnet import build_subnet_resnet, digits_subnet_config

# One intra-op thread (tests/conftest.py: fixed reduction order, no OpenMP spinning).
pytestmark = pytest.mark.usefixtures("one_thread")

LR = 0.1
N, P = 4, 2


def resnet_float64() -> nn.Module:
    return build_subnet_resnet(digits_subnet_config(blocks_per_stage=(1, 1, 1, 1))).double()


def image_batch(seed: int = 0) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    return Batch(torch.rand(8, 1, 8, 8, generator=generator, dtype=torch.float64),
                 torch.randint(0, 10, (8,), generator=generator), 0)


def learner(model: nn.Module, masking: str) -> edgetrain.Learner:
    return edgetrain.Learner(model, method="subnet_dp", optimizer="sgd", lr=LR, probe=False,
                             method_options={"num_workers": N, "overlap": P, "masking": masking, "mask_seed": 0})


def subnetwork_gradient(model: nn.Module, mask: dict[str, torch.Tensor], inputs: torch.Tensor,
                        targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """d/d(theta) of the shard's loss through theta_i = m_i * theta (zero outside m_i by the chain rule)."""
    theta = {name: p.detach().clone().requires_grad_(True) for name, p in model.named_parameters()}
    masked = {name: theta[name] * mask[name] for name in theta}
    # The task loss is a cross-entropy in the model's precision, float64 here (edgetrain/training/losses.py).
    loss = F.cross_entropy(functional_call(model, masked, (inputs,)), targets)
    return dict(zip(theta, torch.autograd.grad(loss, list(theta.values()))))


def test_subnet_dp_step_averages_each_entry_over_exactly_its_owners_block_masking():
    model = resnet_float64()
    trainer = learner(model, "block")
    plan, batch = trainer.method.plan, image_batch()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    masks = [{name: m.to(torch.float64) for name, m in plan.parameter_masks(model, w).items()} for w in range(N)]
    owners = {name: sum(m[name] for m in masks) for name in before}
    total = {name: torch.zeros_like(p) for name, p in before.items()}
    for worker in range(N):
        shard = slice(worker * 2, (worker + 1) * 2)
        grads = subnetwork_gradient(model, masks[worker], batch.inputs[shard], batch.targets[shard])
        for name in total:
            total[name] += grads[name]
    # Block masking: P owners for every residual-branch entry, all N for the stem, shortcuts, classifier.
    branch = {name for name in before if re.match(r"blocks\.\d+\.(conv1|norm1|conv2|norm2)\.", name)}
    for name in before:
        assert bool((owners[name] == (P if name in branch else N)).all()), name
    trainer.step(batch)
    for name, param in model.named_parameters():
        expected = before[name] - LR * total[name] / owners[name]
        assert total[name].abs().max() > 0, name
        torch.testing.assert_close(param.detach(), expected, rtol=1e-10, atol=1e-15, msg=lambda text: f"{name}: {text}")


@pytest.mark.parametrize("masking", ["block", "neuron"])
def test_a_workers_shard_moves_only_the_entries_it_owns(masking: str):
    """Change worker 0's shard only: entries outside m_0 get bit-identical updates, entries inside change."""
    batch = image_batch()
    changed = Batch(batch.inputs.clone(), batch.targets, 0)
    changed.inputs[:2] = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    updates = []
    for data in (batch, changed):
        model = resnet_float64()
        trainer = learner(model, masking)
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        trainer.step(data)
        updates.append({name: p.detach() - before[name] for name, p in model.named_parameters()})
    masks = trainer.method.plan.parameter_masks(model, 0)
    assert not all(bool(m.all()) for m in masks.values())  # worker 0 does not own everything
    for name, mask in masks.items():
        assert torch.equal(updates[0][name][~mask], updates[1][name][~mask]), f"worker 0's data reached {name}"
        if mask.any():  # ... and its data does move what it owns
            assert not torch.equal(updates[0][name][mask], updates[1][name][mask]), name
