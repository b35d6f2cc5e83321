"""subnet_dp in one process: the Learner method (N workers simulated), the schedules, FLOP matching,
the §5 alignment diagnostic, and a quick convergence check on digits."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import edgetrain
import edgetrain.methods.subnet_dp.method  # noqa: F401  (registers subnet_dp)
from edgetrain.data.batch import Batch
from edgetrain.recipes.subnet_dp.config import SubnetDPConfig, epochs_to_run, lr_factor, total_steps
from edgetrain.recipes.subnet_dp.trainer import train_simulated, train_stochastic_depth
from edgetrain.methods.base import METHODS, TrainingError
from edgetrain.methods.subnet_dp.alignment import gradient_alignment, mean_alignment
from edgetrain.methods.subnet_dp.assign import assign_masks
from edgetrain.methods.subnet_dp.method import SubnetDPSimulation
from edgetrain.models.resnet_subnet import build_subnet_resnet, digits_subnet_config
from edgetrain.registry import EdgetrainError


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # small convs: extra threads only contend with the other test processes
    yield
    torch.set_num_threads(before)


def _batch(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return Batch(torch.rand(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g))


def test_registered_and_driven_by_the_learner():
    assert "subnet_dp" in METHODS
    model = build_subnet_resnet(digits_subnet_config())
    learner = edgetrain.Learner(model, method="subnet_dp", lr=0.05, probe=False,
                                method_options={"num_workers": 4, "overlap": 2, "masking": "neuron"},
                                optimizer_options={"momentum": 0.9, "nesterov": True})
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    stats = learner.step(_batch(8))
    assert math.isfinite(stats.loss) and stats.samples == 8
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters() if p.dim() > 1)
    with pytest.raises(TrainingError, match="divisible by N"):
        learner.step(_batch(6))


def test_reachable_by_name_from_a_plain_import_edgetrain():
    """`import edgetrain` imports edgetrain.methods, which registers subnet_dp itself: a user never has
    to import edgetrain.recipes.subnet_dp to get the method (or the subnet ResNet presets) by name."""
    import edgetrain.methods

    assert edgetrain.methods.subnet_dp.__name__ == "edgetrain.methods.subnet_dp"
    assert METHODS.get("subnet_dp") is SubnetDPSimulation
    learner = edgetrain.Learner(edgetrain.load_model("resnet-digits-subnet"), method="subnet_dp", lr=0.05,
                                probe=False, method_options={"num_workers": 2, "overlap": 1, "masking": "block"})
    assert isinstance(learner.method, SubnetDPSimulation) and learner.method.plan.num_workers == 2


def test_load_slack_option_reaches_the_plan():
    model = build_subnet_resnet(digits_subnet_config())
    options = {"num_workers": 8, "overlap": 4, "masking": "block", "mask_seed": 3, "load_slack": 0.0}
    learner = edgetrain.Learner(model, method="subnet_dp", lr=0.05, probe=False, method_options=options)
    expected = assign_masks(model, "block", 8, 4, 3, load_slack=0.0)
    assert learner.method.plan.fingerprint() == expected.fingerprint()
    assert expected.fingerprint() != assign_masks(model, "block", 8, 4, 3).fingerprint()  # the default is 0.2
    assert learner.method.state_dict()["load_slack"] == 0.0


@pytest.mark.parametrize("options,match", [({"num_workers": 0}, "num_workers must be a positive integer"),
                                           ({"overlap": 2.0}, "overlap must be a positive integer"),
                                           ({"num_workers": 2, "overlap": 3}, "1 <= P <= N"),
                                           ({"masking": "layer"}, "unknown masking"),
                                           ({"mask_seed": "a"}, "mask_seed must be an integer"),
                                           ({"load_slack": -1.0}, "load_slack must be a number >= 0"),
                                           ({"masking": "neuron", "load_slack": 0.35}, "block masking only")])
def test_bad_options_are_refused_with_the_reason(options, match):
    model = build_subnet_resnet(digits_subnet_config())
    with pytest.raises(EdgetrainError, match=match):
        edgetrain.Learner(model, method="subnet_dp", lr=0.05, probe=False, method_options=options)


def test_p_equal_n_is_full_batch_gradient_descent():
    """With every mask all ones the average of the N shard gradients is the full-batch mean gradient."""
    model = build_subnet_resnet(digits_subnet_config())
    batch = _batch(8)
    loss, grads = SubnetDPSimulation(model, num_workers=4, overlap=4).gradients(batch)
    reference = F.cross_entropy(model(batch.inputs), batch.targets)
    expected = torch.autograd.grad(reference, list(model.parameters()))
    torch.testing.assert_close(loss, reference.detach(), rtol=1e-5, atol=1e-6)
    for (name, _), want in zip(model.named_parameters(), expected):
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-6)


def test_simulated_average_divides_by_p_with_a_dead_worker():
    """Worker 0 sees an all-zero batch through a branch whose ReLUs are dead: it sends zero gradients
    for its blocks' conv1, and the average still divides by P."""
    model = build_subnet_resnet(digits_subnet_config())
    method = SubnetDPSimulation(model, num_workers=4, overlap=2, masking="block")
    k = method.plan.kept_blocks(0)[0]
    with torch.no_grad():
        model.blocks[k].norm1.bias.fill_(-1e3)  # relu(norm1(.)) = 0 for every worker that holds block k
    batch = _batch(8)
    _, grads = method.gradients(batch)
    shards = method.shards(batch)
    per_worker = [method.worker_gradient(w, *shards[w])[1] for w in range(4)]
    name = f"blocks.{k}.conv1.weight"
    assert all(not per_worker[w][name].any() for w in range(4))  # everyone sends zeros here ...
    name = f"blocks.{k}.norm2.bias"  # ... but norm2's bias still gets a gradient from the owners
    owners = sorted(method.plan.block_owners[k])
    torch.testing.assert_close(grads[name], sum(per_worker[w][name] for w in owners) / 2)


def test_schedules_and_flop_matching():
    config = SubnetDPConfig(lr=0.2, lr_min=0.002, warmup_fraction=0.05, epochs=10)
    total = 1000
    assert lr_factor(0, total, config) == pytest.approx(1 / 50)
    assert lr_factor(49, total, config) == pytest.approx(1.0)
    assert lr_factor(50, total, config) == pytest.approx(1.0)
    assert lr_factor(total, total, config) == pytest.approx(0.01)  # eta_min / eta_max
    assert lr_factor(525, total, config) == pytest.approx(0.505, abs=1e-3)  # half way through the cosine
    steps = SubnetDPConfig(scheduler="multistep", milestones=(0.5, 0.75), warmup_fraction=0.0)
    assert [lr_factor(s, 100, steps) for s in (0, 49, 50, 74, 75, 99)] == pytest.approx([1, 1, .1, .1, .01, .01])
    assert epochs_to_run(config, 8, 4) == 20 and epochs_to_run(config, 8, 3) == pytest.approx(80 / 3)
    assert epochs_to_run(SubnetDPConfig(epochs=10, flop_matched=False), 8, 4) == 10
    assert total_steps(SubnetDPConfig(epochs=2, batch_size=16), 4, 2, 1437) == 4 * 22  # 1437 // 64 = 22
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    from edgetrain.recipes.subnet_dp.config import make_optimizer

    sgd, _ = make_optimizer([torch.nn.Parameter(torch.zeros(1))], config, 10)
    assert sgd.defaults["nesterov"] and sgd.defaults["momentum"] == 0.9
    del optimizer


def test_gradient_alignment_diagnostic():
    model = build_subnet_resnet(digits_subnet_config())
    batch = _batch(16)
    full = assign_masks(model, "block", 4, 4)
    assert gradient_alignment(model, full, 0, batch.inputs, batch.targets)["all"] == pytest.approx(1.0, abs=1e-6)
    plan = assign_masks(model, "neuron", 8, 3, seed=0)
    values = gradient_alignment(model, plan, 0, batch.inputs, batch.targets)
    assert -1.0 <= values["all"] < 0.999 and values["blocks.1.conv1.weight"] is not None
    block = assign_masks(model, "block", 4, 2, seed=0)
    missing = next(w for w in range(4) if not block.holds_block(w, 1))
    assert gradient_alignment(model, block, missing, batch.inputs, batch.targets)["blocks.1.conv1.weight"] is None
    assert mean_alignment(model, block, batch.inputs, batch.targets)["blocks.1.conv1.weight"] is not None
    assert all(p.grad is None for p in model.parameters())


def test_quick_convergence_on_digits(one_thread):
    """Block masking, N = 4, P = 2, two FLOP-matched epochs (four): the masked workers and the unified
    model with branches x P/N learn digits well past chance (measured 93% / 91%). (The comparison
    with DP is the slow multi-process test.)"""
    pytest.importorskip("sklearn")
    from edgetrain.data.digits import load_digits_split

    train = load_digits_split("train", image=True)
    test = load_digits_split("test", image=True)
    config = SubnetDPConfig(masking="block", overlap=2, epochs=2, batch_size=16, lr=0.05)
    result = train_simulated(digits_subnet_config(), train, test, config, num_workers=4)
    assert result["steps"] == 4 * 22
    assert result["test_subnetwork"]["accuracy"] > 0.85, result["test_subnetwork"]
    assert result["test_branch_scaled"]["accuracy"] > 0.8, result["test_branch_scaled"]
    sd = train_stochastic_depth(digits_subnet_config(), train, test, SubnetDPConfig(overlap=2, epochs=1, max_steps=20,
                                                                                     batch_size=16, lr=0.2), 4)
    assert sd["steps"] == 20 and math.isfinite(sd["final_loss"]) and 0.0 <= sd["test"]["accuracy"] <= 1.0
