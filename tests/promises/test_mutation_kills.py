"""Promises that mutation testing (tools/mutation, docs/mutation.md) found unguarded: each test here
kills a mutant that every other test let survive. Named after the promise, not the mutant."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import edgetrain
from edgetrain.data.batch import Batch
from edgetrain.training.losses import task_loss
from edgetrain.methods import METHODS
from float64_mlp import feature_batches, mlp_float64

pytestmark = pytest.mark.usefixtures("one_thread")


def flat_weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


# -- mezo ---------------------------------------------------------------------------------------------

def test_mezo_default_estimate_is_the_directional_derivative_along_z():
    # The default epsilon must be small enough that (L(theta + eps z) - L(theta - eps z)) / 2 eps is
    # the derivative along z, not a secant over a large step.
    model, batch, seed = mlp_float64(), feature_batches(1)[0], 11
    method = METHODS.get("mezo")(model)
    _, projected = method.projected_gradient(batch, seed)
    generator = torch.Generator().manual_seed(seed)
    z = [torch.randn(p.shape, generator=generator, dtype=p.dtype) for p in model.parameters()]
    grads = torch.autograd.grad(task_loss(model, model(batch.inputs), batch.targets), list(model.parameters()))
    directional = sum(float((g * d).sum()) for g, d in zip(grads, z))
    assert abs(directional) > 0.05
    assert projected == pytest.approx(directional, rel=1e-3)


def test_mezo_draws_a_fresh_direction_every_step():
    # One z for every step would confine training to a line through the initial weights.
    model = mlp_float64()
    learner = edgetrain.Learner(model, method="mezo", optimizer="sgd", lr=0.05, probe=False,
                                method_options={"seed": 3})
    points = [flat_weights(model)]
    for batch in feature_batches(2):
        learner.step(batch)
        points.append(flat_weights(model))
    first, second = points[1] - points[0], points[2] - points[1]
    assert float(torch.nn.functional.cosine_similarity(first, second, dim=0).abs()) < 0.9


def test_mezo_with_plain_sgd_updates_in_place_without_the_optimizer():
    # The memory-lean path of the paper: z regenerated per parameter, no gradient buffers, so
    # torch's optimizer step (which reads .grad) must not run.
    model = mlp_float64()
    learner = edgetrain.Learner(model, method="mezo", optimizer="sgd", lr=0.05, probe=False)
    calls = []
    learner.optimizer.register_step_pre_hook(lambda *_: calls.append(1))
    before = flat_weights(model)
    learner.step(feature_batches(1)[0])
    assert calls == []
    assert not torch.equal(flat_weights(model), before)


@pytest.mark.parametrize("rates,weight_decay", [((0.05, 0.05), 0.1), ((0.05, 0.2), 0.0)],
                         ids=["weight-decay-without-momentum", "two-groups-two-rates"])
def test_mezo_through_sgd_steps_like_torch_sgd_fed_g_z(rates: tuple[float, float], weight_decay: float):
    # Only SGD with no decay, momentum or maximize may take the in-place path, and it must honour
    # each group's own rate: otherwise the result must be torch's SGD step on .grad = g z.
    def setup() -> tuple[nn.Module, torch.optim.SGD]:
        model = mlp_float64()
        groups = [{"params": list(model.blocks.parameters()), "lr": rates[0]},
                  {"params": list(model.head.parameters()), "lr": rates[1]}]
        return model, torch.optim.SGD(groups, weight_decay=weight_decay)

    model, optimizer = setup()
    reference, reference_optimizer = setup()
    assert len(list(model.parameters())) == sum(len(g["params"]) for g in optimizer.param_groups)
    method = METHODS.get("mezo")(model, seed=5)
    estimator = METHODS.get("mezo")(reference, seed=5)
    for batch in feature_batches(2):
        _, grads = estimator.gradients(batch)
        for name, param in reference.named_parameters():
            param.grad = grads[name]
        reference_optimizer.step()
        estimator.steps_taken += 1  # gradients() is the diagnostic path: it does not count a step
        method.step(batch, optimizer)
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.detach(), expected.detach(), rtol=1e-10, atol=1e-14, msg=name)


# -- bp / mebp ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["bp", "mebp"])
def test_backprop_keeps_no_gradient_buffers_between_steps(method: str, tiny_lora, text_batches):
    # Between steps only the weights (and optimizer state) are held: the memory budget counts
    # weights plus the step's measured peak, not a gradient per parameter left over.
    learner = edgetrain.Learner(tiny_lora(), method=method, optimizer="sgd", lr=0.1, probe=False)
    learner.step(text_batches(1)[0])
    assert all(param.grad is None for param in learner.params.values())


@pytest.mark.parametrize("method", ["bp", "mebp"])
def test_backprop_compute_gradients_is_this_batch_gradient_whatever_grad_held(method: str, tiny_lora, text_batches):
    model, batch = tiny_lora(), text_batches(1)[0]
    learner = edgetrain.Learner(model, method=method, probe=False)
    _, expected = learner.compute_gradients(batch)
    for param in learner.params.values():  # left over from the caller's own backward, say
        param.grad = torch.ones_like(param)
    _, grads = learner.compute_gradients(batch)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=0, msg=name)


class _BlocksAndAScale(nn.Module):
    """A block view (embed, blocks, head) plus a trainable parameter outside it, and a weight tied
    between two modules: MeZO cannot run this model unit by unit and must perturb it whole."""
    task = "classify"

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 5, dtype=torch.float64)
        self.blocks = nn.ModuleList([nn.Linear(5, 5, dtype=torch.float64)])
        self.head = nn.Linear(5, 5, dtype=torch.float64)
        self.head.weight = self.blocks[0].weight  # tied: one parameter under two names
        self.scale = nn.Parameter(torch.tensor(1.3, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        h = torch.tanh(self.blocks[0](h))
        return self.head(h) * self.scale


def test_mezo_perturbs_a_model_without_a_complete_block_view_whole_tied_weights_included():
    model = _BlocksAndAScale()
    generator = torch.Generator().manual_seed(4)
    batch = Batch(torch.randn(6, 4, generator=generator, dtype=torch.float64),
                  torch.randint(0, 5, (6,), generator=generator), 0)
    before = flat_weights(model)
    method = METHODS.get("mezo")(model)
    _, projected = method.projected_gradient(batch, 9)
    assert torch.equal(flat_weights(model), before)
    # z regenerated as documented: one generator seeded with the step's seed, one draw per trainable
    # parameter in the model's order (the tied one once).
    generator = torch.Generator().manual_seed(9)
    params = [p for _, p in model.named_parameters()]
    z = [torch.randn(p.shape, generator=generator, dtype=p.dtype) for p in params]
    grads = torch.autograd.grad(task_loss(model, model(batch.inputs), batch.targets), params)
    directional = sum(float((g * d).sum()) for g, d in zip(grads, z))
    assert abs(directional) > 0.05
    assert projected == pytest.approx(directional, rel=1e-3)


def test_mezo_forwards_build_no_autograd_graph():
    # MeZO needs no more memory than inference: its two forwards must not record the activations that
    # a backward would need, although the perturbed weights derive from parameters that require grad.
    model = mlp_float64()
    loss, _ = METHODS.get("mezo")(model).projected_gradient(feature_batches(1)[0], 2)
    assert all(p.requires_grad for p in model.parameters())
    assert not loss.requires_grad and loss.grad_fn is None


# -- defaults -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("method,defaults", [
    ("mezo", {"epsilon": 1e-3, "seed": 0}),
    ("fgd", {"seed": 0, "alpha_spec": 1.0, "num_tangents": 1}),
])
def test_method_defaults_are_the_documented_ones(method: str, defaults: dict):
    # The module docstrings (edgetrain/methods/mezo.py, fgd.py) say these; a run with the defaults is
    # only reproducible across versions if they stay.
    built = METHODS.get(method)(mlp_float64())
    assert {key: getattr(built, key) for key in defaults} == defaults


def test_subnet_dp_defaults_are_the_documented_ones():
    import edgetrain.methods.subnet_dp.method as subnet

    built = subnet.SubnetDPSimulation(_subnet_resnet())
    assert built.options == {"num_workers": 4, "overlap": 2, "masking": "block", "mask_seed": 0, "load_slack": None}


# -- subnet DP ----------------------------------------------------------------------------------------

def _subnet_resnet() -> nn.Module:
    from edgetrain.models.resnet_subnet import build_subnet_resnet, digits_subnet_config

    return build_subnet_resnet(digits_subnet_config())

def test_subnet_dp_resumes_only_into_the_same_worker_plan(tmp_path):
    # Another N, P or mask seed would average over other owners: the resumed run would not be the
    # checkpointed one.
    import edgetrain.methods.subnet_dp.method  # noqa: F401  (registers subnet_dp)

    def learner(**options):
        return edgetrain.Learner(_subnet_resnet(), method="subnet_dp", optimizer="sgd", lr=0.05, probe=False,
                                 method_options={"num_workers": 2, "overlap": 1, **options})

    generator = torch.Generator().manual_seed(0)
    saved = learner()
    saved.step(Batch(torch.rand(4, 1, 8, 8, generator=generator), torch.randint(0, 10, (4,), generator=generator), 0))
    path = saved.save(tmp_path / "subnet.safetensors")
    resumed = learner().load(path)
    assert resumed.steps_done == 1
    with pytest.raises(edgetrain.EdgetrainError, match="subnet_dp"):
        learner(mask_seed=5).load(path)


def test_subnet_dp_with_one_worker_is_plain_gradient_descent():
    # N = P = 1 is the degenerate plan a user reaches by scaling a run down: one worker owning
    # everything, so its average is its own full-batch gradient.
    import torch.nn.functional as F

    from edgetrain.methods.subnet_dp.method import SubnetDPSimulation

    model = _subnet_resnet()
    generator = torch.Generator().manual_seed(1)
    batch = Batch(torch.rand(6, 1, 8, 8, generator=generator), torch.randint(0, 10, (6,), generator=generator), 0)
    loss, grads = SubnetDPSimulation(model, num_workers=1, overlap=1).gradients(batch)
    reference = F.cross_entropy(model(batch.inputs), batch.targets)
    expected = torch.autograd.grad(reference, list(model.parameters()))
    torch.testing.assert_close(loss, reference.detach(), rtol=1e-6, atol=1e-7)
    for (name, _), want in zip(model.named_parameters(), expected):
        torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("members,payload,expected", [(1, 1000, 0), (2, 1000, 1000), (4, 1000, 1500),
                                                      (5, 1000, 1600)])
def test_subnet_wire_bytes_are_a_ring_all_reduce(members: int, payload: int, expected: int):
    # The subnet run's report counts what each rank sends: a ring all-reduce among n ranks sends
    # 2 (n - 1) / n of the payload, and a set of one sends nothing.
    from edgetrain.recipes.subnet_dp.averaging import _ring_wire_bytes

    assert _ring_wire_bytes(payload, members) == expected


def test_mezo_refuses_an_epsilon_its_parameters_dtype_cannot_hold_and_takes_the_largest_it_can():
    # theta + eps z is computed in the parameters' dtype: float16 holds at most 65504. An epsilon past it
    # is refused by name when the method is built (not inside torch at the first step); 65504 itself is
    # representable and is taken. Integer buffers and parameters are not the check's business.
    model = nn.Sequential(nn.Linear(3, 2)).to(torch.float16)
    with pytest.raises(edgetrain.EdgetrainError, match=r"mezo: epsilon 100000\.0 is beyond what 0\.weight's "
                                                        r"torch\.float16 holds"):
        METHODS.get("mezo")(model, epsilon=1e5)
    assert METHODS.get("mezo")(model, epsilon=65504.0).epsilon == 65504.0
    assert METHODS.get("mezo")(nn.Linear(3, 2), epsilon=1e5).epsilon == 1e5  # float32 holds it
