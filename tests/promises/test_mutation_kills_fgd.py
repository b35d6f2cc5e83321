"""Promises of fgd that mutation testing found unguarded (tools/mutation fgd, docs/mutation.md): each test
here kills a mutant of edgetrain/methods/fgd.py that every other test let survive. Named after the
promise, not the mutant."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn

import edgetrain
from edgetrain.training.losses import task_loss
from edgetrain.methods.base import NonFiniteError
from edgetrain.methods.fgd import ForwardGradient
from edgetrain.methods.tangents import TangentKey, draw_tangent
from edgetrain.models.mlp import MLPConfig, build_mlp
from float64_mlp import feature_batches, mlp_float64

pytestmark = pytest.mark.usefixtures("one_thread")

FLOAT64_MAX = torch.finfo(torch.float64).max


class WithAuxiliaryHead(nn.Module):
    """The float64 MLP plus an auxiliary head its forward never uses. The loss does not depend on the
    head, so its weights can be put anywhere -- at the edge of the float range too -- without changing
    the loss or any directional derivative. No block view: the model is one unit, its trainable
    parameters in the order net.*, aux.weight, aux.bias."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp_float64()
        self.aux = nn.Linear(4, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p, before[name]) for name, p in model.named_parameters())


# -- no autograd graph, no forward-AD state left behind ------------------------------------------------

def test_fgd_builds_no_autograd_graph_even_with_a_frozen_group():
    # fgd's memory promise is inference memory: nothing is kept for a backward. A frozen (alpha = 0)
    # parameter still has requires_grad, so a forward outside no_grad would record a graph through
    # it and keep every later activation alive until the loss is dropped.
    model = mlp_float64()
    learner = edgetrain.Learner(model, method="fgd", optimizer="sgd", lr=0.05, probe=False,
                                method_options={"seed": 3, "num_tangents": 2, "alpha": {"blocks.0": 0.0}})
    seen = []
    for module in model.modules():
        module.register_forward_hook(lambda module, args, output: seen.append(output.requires_grad))
    for batch in feature_batches(2):
        learner.step(batch)
    assert seen and not any(seen)


def test_fgd_leaves_no_forward_ad_level_open():
    # torch allows one dual level per process: a level fgd left open would make the user's own
    # forward-mode AD (torch.autograd.forward_ad, a later fgd learner in a thread) fail with
    # "Nested forward mode AD is not supported".
    model = mlp_float64()
    learner = edgetrain.Learner(model, method="fgd", optimizer="sgd", lr=0.05, probe=False,
                                method_options={"num_tangents": 2})
    batches = feature_batches(3)
    for batch in batches[:2]:
        learner.step(batch)
    learner.compute_gradients(batches[2])
    x, t = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    with fwAD.dual_level():
        derivative = fwAD.unpack_dual((fwAD.make_dual(x, t) ** 2).sum()).tangent
    assert torch.allclose(derivative, 2 * (x * t).sum())


# -- BatchNorm running statistics ----------------------------------------------------------------------

@pytest.mark.parametrize("num_tangents,alpha", [(1, 1.0), (3, 1.0), (3, {"blocks.1": 0.0})],
                         ids=["one-tangent", "three-tangents", "three-tangents-frozen-block"])
def test_batchnorm_running_statistics_move_exactly_as_one_training_forward_moves_them(num_tangents, alpha):
    # Every tangent re-runs each unit on the same input; the running statistics are the model's
    # evaluation-time normalisation and must move once per step, as in backprop training -- not once
    # per tangent, not twice, and not never.
    model = build_mlp(MLPConfig(input_shape=(8,), hidden_sizes=(6, 5), num_classes=3, activation="tanh",
                                batch_norm=True, seed=0)).double()
    reference = copy.deepcopy(model)
    batch = feature_batches(1)[0]
    with torch.no_grad():
        reference(batch.inputs)  # one training-mode forward with the same weights
    learner = edgetrain.Learner(model, method="fgd", optimizer="sgd", lr=0.05, probe=False,
                                method_options={"seed": 1, "num_tangents": num_tangents, "alpha": alpha})
    learner.step(batch)
    buffers = dict(model.named_buffers())
    assert buffers
    for name, expected in reference.named_buffers():
        torch.testing.assert_close(buffers[name], expected, msg=name)


# -- the gradient estimate -------------------------------------------------------------------------------

@pytest.mark.parametrize("tangent_checkpoint", [True, False])
def test_a_loss_that_does_not_depend_on_the_perturbed_parameters_gives_a_zero_estimate(tangent_checkpoint):
    # The estimate is (dL/du) u; when no perturbed parameter reaches the loss, dL/du is exactly 0 and
    # nothing may move -- and the step must still report the loss and use up the tangents it kept.
    model = WithAuxiliaryHead()
    learner = edgetrain.Learner(model, method="fgd", optimizer="sgd", lr=0.05, probe=False,
                                method_options={"num_tangents": 2, "alpha": {"": 0.0, "aux": 1.0},
                                                "tangent_checkpoint": tangent_checkpoint})
    batch = feature_batches(1)[0]
    before = weights(model)
    with torch.no_grad():
        expected_loss = float(task_loss(model, model(batch.inputs), batch.targets))
    loss, estimate = learner.compute_gradients(batch)
    assert loss == pytest.approx(expected_loss)
    assert not any(g.any() for g in estimate.values())
    assert learner.step(batch).loss == pytest.approx(expected_loss)
    assert unchanged(model, before)
    assert learner.method.bank.kept_bytes() == 0


# -- all or nothing, and exactly the update that would be written ----------------------------------------
# A weight at the edge of float64's range stands in for float16's 65504, which on-device runs do reach.

def test_a_refused_update_writes_nothing_even_when_a_frozen_group_comes_first():
    # The check before the in-place update must look at every perturbed parameter, not stop at the
    # first frozen one: otherwise a non-finite weight is written after all and the run is poisoned.
    model = WithAuxiliaryHead()
    method = ForwardGradient(model, seed=2, alpha={"net.blocks.0": 0.0})
    assert next(iter(method.params)).startswith("net.blocks.0.")  # the frozen group is checked first
    with torch.no_grad():
        model.aux.weight.fill_(FLOAT64_MAX)  # any outward change of 1e292 or more overflows it
    before = weights(model)
    with pytest.raises(NonFiniteError, match="update of aux.weight would make it non-finite"):
        method.step(feature_batches(1)[0], torch.optim.SGD(model.parameters(), lr=1e300))
    assert unchanged(model, before)
    assert method.steps_taken == 0


def test_an_update_whose_new_weights_are_all_finite_is_applied_at_the_edge_of_the_float_range():
    # The check computes each new weight exactly as the update writes it (its sign, 1 / num_tangents,
    # one tangent after the other): a check of some other value refuses steps that are fine (training
    # stops for nothing) or lets through ones that overflow.
    model, seed, num_tangents = WithAuxiliaryHead(), 4, 2
    method = ForwardGradient(model, seed=seed, num_tangents=num_tangents)
    batch = feature_batches(1)[0]
    _, derivatives = method.loss_and_derivatives(batch, 0)  # the step's, sample 0
    # How far each weight has moved after each tangent's in-place add, per unit learning rate.
    partials = {}
    for index, (name, param) in enumerate(model.named_parameters()):
        change, partials[name] = torch.zeros_like(param), []
        for draw, derivative in enumerate(derivatives):
            tangent = draw_tangent(param.detach(), TangentKey(seed, 0, 0, draw).parameter_seed(index))
            change = change - derivative / num_tangents * tangent
            partials[name].append(change)
    largest = max(float(p.abs().max()) for each in partials.values() for p in each)
    lr = 0.6 * FLOAT64_MAX / largest  # the largest change on the way is 0.6 of the float64 range
    # Put the auxiliary head 0.9 of the range out on the side every partial change of the element
    # moves away from: its new value is finite, while the same change the other way overflows.
    aux = torch.stack(partials["aux.weight"])
    inward = (aux.sign() == aux[-1].sign()).all(dim=0) & (aux[-1] != 0)
    assert (aux.abs().amax(dim=0)[inward] * lr > 0.15 * FLOAT64_MAX).any()
    with torch.no_grad():
        model.aux.weight.copy_(torch.where(inward, -0.9 * FLOAT64_MAX * aux[-1].sign(), 0.0))
    before = weights(model)
    method.step(batch, torch.optim.SGD(model.parameters(), lr=lr))
    assert method.steps_taken == 1
    for name, param in model.named_parameters():
        expected = before[name] + lr * partials[name][-1]
        assert torch.isfinite(param).all(), name
        torch.testing.assert_close(param.detach(), expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max()))


# -- tangents: regenerated, never kept by default, dropped when a step fails -----------------------------

def test_default_fgd_keeps_no_tangent_between_forward_and_update():
    # Tangent checkpointing is the default: a parameter-sized tangent per parameter held from the
    # forward to the update would be a second copy of the model, exactly what fgd exists to avoid.
    model = mlp_float64()
    learner = edgetrain.Learner(model, method="fgd", optimizer="sgd", lr=0.05, probe=False,
                                method_options={"num_tangents": 2})
    kept_during_forward = []
    model.head.register_forward_hook(lambda *_: kept_during_forward.append(learner.method.bank.kept_bytes()))
    learner.step(feature_batches(1)[0])
    assert kept_during_forward and not any(kept_during_forward)


def test_a_failed_step_or_estimate_keeps_no_tangent_behind():
    # Without tangent checkpointing the forward keeps its tangents for the update; when the step
    # stops before the update they must be dropped, not held until some later step overwrites them.
    model = mlp_float64()
    method = ForwardGradient(model, num_tangents=2, tangent_checkpoint=False)
    bad = feature_batches(1)[0]
    bad.inputs[0, 0] = float("nan")  # the learner's batch validation would refuse it; call the method
    with pytest.raises(NonFiniteError):
        method.step(bad, torch.optim.SGD(model.parameters(), lr=0.05))
    assert method.bank.kept_bytes() == 0
    with pytest.raises(NonFiniteError):
        method.gradients(bad)
    assert method.bank.kept_bytes() == 0
