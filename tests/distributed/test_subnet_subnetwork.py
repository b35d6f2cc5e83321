"""Subnetwork data parallelism: physically smaller subnetworks agree with the masked full model."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgetrain.recipes.subnet_dp.averaging import average_masked_gradients
from edgetrain.methods.subnet_dp.assign import assign_masks
from edgetrain.methods.subnet_dp.subnetwork import (DroppedBlock, SlimBasicBlock, SubsetGroupNorm,
                                                     full_model_from_subnetworks, masked_forward,
                                                     materialise_subnetwork)
from edgetrain.models.resnet_subnet import (SubnetResNetConfig, build_subnet_resnet, digits_subnet_config,
                                            initial_parameter)

CONFIG = digits_subnet_config(width=8)
CASES = [("neuron", 4, 2), ("neuron", 8, 3), ("neuron", 3, 1), ("block", 4, 2), ("block", 8, 3), ("block", 5, 5)]


@pytest.fixture(scope="module")
def full():
    torch.manual_seed(0)
    model = build_subnet_resnet(CONFIG)
    with torch.no_grad():  # non-trivial norms, so a wrong group or channel shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _inputs(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


@pytest.mark.parametrize("kind,n,p", CASES)
def test_subnetwork_forward_and_gradient_equal_the_masked_full_model(full, kind, n, p):
    plan = assign_masks(full, kind, n, p, seed=11)
    x, y = _inputs()
    for worker in range(n):
        subnet = materialise_subnetwork(CONFIG, plan, worker, source=full)
        sub_loss = F.cross_entropy(subnet(x), y)
        ref_loss = F.cross_entropy(masked_forward(full, plan, worker, x), y)
        torch.testing.assert_close(sub_loss, ref_loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(subnet(x), masked_forward(full, plan, worker, x), rtol=1e-5, atol=1e-5)
        sub_grads = torch.autograd.grad(sub_loss, list(subnet.parameters()))
        names = [name for name, _ in subnet.named_parameters()]
        params = dict(full.named_parameters())
        ref_grads = dict(zip(params, torch.autograd.grad(ref_loss, list(params.values()), allow_unused=True)))
        for name, grad in zip(names, sub_grads):
            torch.testing.assert_close(subnet.to_full(name, grad), ref_grads[name], rtol=1e-4, atol=1e-6)
        # (g_i)_j = 0 outside the mask: what the subnetwork does not hold gets no gradient in the reference
        masks = plan.parameter_masks(full, worker)
        for name, grad in ref_grads.items():
            outside = grad[~masks[name]] if grad is not None else torch.zeros(0)
            assert not bool(outside.any()), name


def test_subnetworks_are_physically_smaller(full):
    total = sum(p.numel() for p in full.parameters())
    neuron = assign_masks(full, "neuron", 4, 2, seed=0)
    subnet = materialise_subnetwork(CONFIG, neuron, 1)
    assert all(isinstance(b, SlimBasicBlock) for b in subnet.blocks)
    for k, block in enumerate(subnet.blocks):
        kept = len(neuron.kept_channels(1, k))
        assert block.conv1.weight.shape[0] == kept == block.conv2.weight.shape[1] == block.norm1.weight.numel()
        assert kept < full.blocks[k].conv1.out_channels
    assert sum(p.numel() for p in subnet.parameters()) == neuron.worker_parameter_count(full, 1) < 0.53 * total
    block = assign_masks(full, "block", 4, 2, seed=0)
    subnet = materialise_subnetwork(CONFIG, block, 2)
    dropped = [k for k in range(len(full.blocks)) if not block.holds_block(2, k)]
    assert dropped and all(isinstance(subnet.blocks[k], DroppedBlock) for k in dropped)
    for k in dropped:  # a dropped block holds nothing but a projection shortcut (a stage's first block)
        names = [n for n, _ in subnet.blocks[k].named_parameters()]
        assert all(n.startswith("shortcut.") for n in names)
    assert sum(p.numel() for p in subnet.parameters()) == block.worker_parameter_count(full, 2) < 0.53 * total


def test_materialised_from_init_matches_the_full_model_init():
    """Every worker draws its slices from the per-name init: owners start equal, and equal to the full
    model that P = N and evaluation use -- without building the full model."""
    config = digits_subnet_config(width=8, masked_fan_out_fraction=0.5, seed=3)
    model = build_subnet_resnet(config)
    plan = assign_masks(model, "neuron", 4, 2, seed=0)
    for worker in range(4):
        subnet = materialise_subnetwork(config, plan, worker)
        for name, param in subnet.named_parameters():
            torch.testing.assert_close(param, subnet.from_full(name, dict(model.named_parameters())[name]))
    subnets = [materialise_subnetwork(config, plan, w) for w in range(4)]
    rebuilt = full_model_from_subnetworks(config, subnets)
    for (name, a), (_, b) in zip(rebuilt.named_parameters(), model.named_parameters()):
        assert torch.equal(a, b), name


def test_fan_out_corrected_init():
    """§4: conv1's He-normal std uses the fan-out of the active output units, out * k * k * P / N."""
    name, shape = "blocks.6.conv1.weight", (64, 32, 3, 3)
    base = initial_parameter(SubnetResNetConfig(width=8), name, shape).std()
    half = initial_parameter(SubnetResNetConfig(width=8, masked_fan_out_fraction=0.5), name, shape).std()
    assert abs(float(base) - (2 / (64 * 9)) ** 0.5) < 0.01
    assert abs(float(half / base) - 2 ** 0.5) < 0.01
    other = initial_parameter(SubnetResNetConfig(width=8, masked_fan_out_fraction=0.5), "blocks.6.conv2.weight",
                              (64, 64, 3, 3)).std()
    assert abs(float(other) - (2 / (64 * 9)) ** 0.5) < 0.01  # conv2's outputs are the unmasked stream


def test_subset_group_norm():
    x = torch.randn(3, 6, 4, 4)
    norm = SubsetGroupNorm((3, 3))
    torch.testing.assert_close(norm(x), F.group_norm(x, 2))
    uneven = SubsetGroupNorm((2, 0, 4))
    out = uneven(x)
    torch.testing.assert_close(out[:, :2], F.group_norm(x[:, :2], 1))
    torch.testing.assert_close(out[:, 2:], F.group_norm(x[:, 2:], 1))


def test_reference_average_divides_by_owner_count_not_by_nonzero_senders(full):
    """A worker with dead ReLUs sends zeros; they count in the average (sum / P)."""
    plan = assign_masks(full, "block", 4, 2, seed=0)
    shapes = {n: p.shape for n, p in full.named_parameters()}
    grads = [{n: torch.full(s, 0.0 if w == 0 else float(w + 1)) for n, s in shapes.items()} for w in range(4)]
    avg = average_masked_gradients(grads, plan, shapes)
    k = plan.kept_blocks(0)[0]
    owners = sorted(plan.block_owners[k])
    expected = sum(0.0 if w == 0 else w + 1 for w in owners) / 2
    assert torch.all(avg[f"blocks.{k}.conv1.weight"] == expected)
    assert expected != sum(w + 1 for w in owners if w != 0) / len([w for w in owners if w != 0]) or len(owners) == 1
    assert torch.all(avg["embed.conv.weight"] == (0 + 2 + 3 + 4) / 4)  # the trunk: all N owners
