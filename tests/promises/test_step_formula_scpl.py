"""One step equals its formula: an `scpl` step moves each component's parameters (its units and its local
projection head) by -lr * grad of that component's own local loss -- SupCon of its projected output for
components 1..L-1, the task loss for the last -- each component fed the previous component's output at
the step's starting weights, detached. No gradient crosses a component boundary: changing a later
component's loss leaves every earlier component's update as it was.

The model: a Tanh MLP cut into embed+blocks.0 | blocks.1 | blocks.2+head (flat features: one view, no
augmentation), float64."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import edgetrain
from edgetrain.data.batch import Batch
from edgetrain.methods.scpl import supcon_loss
import float64_mlp

# One intra-op thread (tests/conftest.py: fixed reduction order, no OpenMP spinning).
pytestmark = pytest.mark.usefixtures("one_thread")

LR = 0.1
TEMPERATURE = 0.5
OPTIONS = {"num_components": 3, "projection_dims": (8, 4), "temperature": TEMPERATURE}


def mlp_float64() -> nn.Module:
    return float64_mlp.mlp_float64((6, 5, 7))


def feature_batch(seed: int = 0) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    # Every class at least twice, so every SupCon anchor has a positive.
    return Batch(torch.randn(12, 8, generator=generator, dtype=torch.float64), torch.arange(12) % 3, 0)


def component_modules(model: nn.Module) -> list[tuple[list[nn.Module], nn.Module | None]]:
    """(units, local head) of each component, written out for this model."""
    return [([model.embed, model.blocks[0]], model.scpl_projections[0]),
            ([model.blocks[1]], model.scpl_projections[1]),
            ([model.blocks[2], model.head], None)]


def local_gradients(model: nn.Module, batch: Batch) -> list[dict[str, torch.Tensor]]:
    """Per component: d(its local loss)/d(its own parameters), its input the previous output, detached."""
    names = {id(p): name for name, p in model.named_parameters()}
    result, h = [], batch.inputs
    for units, local_head in component_modules(model):
        r = h.detach()
        for unit in units:
            r = unit(r)
        if local_head is None:
            loss = F.cross_entropy(r, batch.targets)  # the task loss, float64 for float64 as in edgetrain/training/losses.py
        else:
            loss = supcon_loss(local_head(r), batch.targets, temperature=TEMPERATURE)
        own = [p for module in [*units, local_head] if module is not None for p in module.parameters()]
        result.append({names[id(p)]: g for p, g in zip(own, torch.autograd.grad(loss, own))})
        h = r
    return result


def test_scpl_step_moves_each_component_by_the_gradient_of_its_own_local_loss():
    model = mlp_float64()
    learner = edgetrain.Learner(model, method="scpl", optimizer="sgd", lr=LR, probe=False, method_options=OPTIONS)
    batch = feature_batch()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    per_component = local_gradients(model, batch)
    owned = [name for grads in per_component for name in grads]
    assert sorted(owned) == sorted(before)  # each parameter in exactly one component
    learner.step(batch)
    for index, grads in enumerate(per_component):
        for name, grad in grads.items():
            assert grad.abs().max() > 0, name
            torch.testing.assert_close(model.get_parameter(name).detach(), before[name] - LR * grad,
                                       rtol=1e-12, atol=1e-15, msg=lambda text: f"component {index}, {name}: {text}")


@pytest.mark.parametrize("changed", [1, 2])
def test_changing_a_later_components_loss_leaves_earlier_updates_unchanged(changed: int, monkeypatch):
    batch = feature_batch()
    updates = []
    for scale in (1.0, 2.0):  # a power of two scales the loss and its gradient exactly
        model = mlp_float64()
        learner = edgetrain.Learner(model, method="scpl", optimizer="sgd", lr=LR, probe=False, method_options=OPTIONS)
        component = learner.method.components[changed]
        original = component.local_loss
        monkeypatch.setattr(component, "local_loss", lambda out, y: original(out, y) * scale)
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        learner.step(batch)
        updates.append([{name: model.get_parameter(name).detach() - before[name] for name in c.params}
                        for c in learner.method.components])
    plain, scaled = updates
    for index in range(len(plain)):
        for name in plain[index]:
            if index < changed:  # bit for bit: nothing of the later loss reached it
                assert torch.equal(scaled[index][name], plain[index][name]), f"{name} felt component {changed}'s loss"
            elif index == changed:
                torch.testing.assert_close(scaled[index][name], 2.0 * plain[index][name], rtol=1e-10, atol=1e-16)
