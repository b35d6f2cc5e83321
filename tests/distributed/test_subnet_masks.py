"""Subnetwork data parallelism: ownership masks (§3.1-3.2) -- coverage, reproducibility, refusals."""
from __future__ import annotations

import pytest
import torch

from edgetrain.distributed.subnet.masks import (MaskError, ResNetLayout, SubnetPlan, assign_masks, owner_counts,
                                                parameter_role, plan_from_parameter_masks)
from edgetrain.models.resnet import ResNet, ResNetConfig
from edgetrain.models.resnet_subnet import SubnetResNetConfig, build_subnet_resnet, digits_subnet_config


@pytest.fixture(scope="module")
def model():
    # ResNet-18's layout (4 stages of 2 blocks) at 1/8 width on 8x8 digits: 176k parameters.
    return build_subnet_resnet(digits_subnet_config())


@pytest.fixture(scope="module")
def layout(model):
    return ResNetLayout.of(model)


PAIRS = [(n, p) for n in range(1, 9) for p in range(1, n + 1)]


@pytest.mark.parametrize("kind", ["neuron", "block"])
def test_every_parameter_is_owned_by_exactly_p_workers(model, layout, kind):
    """sum_i m_i = P on every masked entry and N on the replicated trunk, for 1 <= P <= N <= 8."""
    for n, p in PAIRS:
        plan = assign_masks(layout, kind, n, p, seed=n * 10 + p)
        counts = owner_counts(plan, model)
        for name, count in counts.items():
            expected = n if parameter_role(name, kind)[0] == "replicated" else p
            assert bool((count == expected).all()), (kind, n, p, name, count.unique())
        # every worker has a path through at least one branch (validation would have refused otherwise)
        for worker in range(n):
            if kind == "block":
                assert plan.kept_blocks(worker)
            else:
                assert all(plan.kept_channels(worker, k) for k in range(layout.num_blocks))


@pytest.mark.parametrize("kind", ["neuron", "block"])
def test_masks_are_reproducible_from_the_seed(layout, kind):
    a = assign_masks(layout, kind, 8, 3, seed=7)
    b = assign_masks(layout, kind, 8, 3, seed=7)
    c = assign_masks(layout, kind, 8, 3, seed=8)
    assert a.fingerprint() == b.fingerprint() and a.channel_owners == b.channel_owners
    assert a.fingerprint() != c.fingerprint()


def test_masking_keeps_memory_balanced_and_workers_distinct(model, layout):
    total = sum(p.numel() for p in model.parameters())
    for kind in ("neuron", "block"):
        plan = assign_masks(layout, kind, 4, 2, seed=0)
        fractions = [plan.worker_parameter_count(model, w) / total for w in range(4)]
        assert all(abs(f - 0.5) < 0.04 for f in fractions), (kind, fractions)
        # no two workers train the same subnetwork (N = 4, P = 2 must not pair workers up)
        views = {tuple(plan.kept_channels(w, k) for k in range(layout.num_blocks)) for w in range(4)}
        assert len(views) == 4, kind
    neuron = assign_masks(layout, "neuron", 8, 3, seed=0)
    fractions = [neuron.worker_parameter_count(model, w) / total for w in range(8)]
    assert max(fractions) - min(fractions) < 0.01


def test_neuron_masks_slice_conv1_rows_norm1_and_conv2_columns_together(model, layout):
    """Eq. 1-2: output channel c of conv1 and input channel c of conv2 share one mask; norm1's groups
    keep (almost) the same number of channels each, so its statistics cover active channels only."""
    plan = assign_masks(layout, "neuron", 4, 2, seed=3)
    for worker in range(4):
        masks = plan.parameter_masks(model, worker)
        for k in range(layout.num_blocks):
            rows = masks[f"blocks.{k}.conv1.weight"].flatten(1).all(1)
            assert bool((rows == masks[f"blocks.{k}.conv1.weight"].flatten(1).any(1)).all())
            cols = masks[f"blocks.{k}.conv2.weight"].transpose(0, 1).flatten(1).all(1)
            assert torch.equal(rows, cols) and torch.equal(rows, masks[f"blocks.{k}.norm1.weight"])
            assert torch.equal(rows, plan.channel_mask(worker, k))
            assert max(plan.group_sizes(worker, k)) - min(plan.group_sizes(worker, k)) <= 1
            assert bool(masks[f"blocks.{k}.norm2.weight"].all())  # the residual stream is the trunk


def test_block_masks_keep_or_drop_a_branch_whole(model, layout):
    plan = assign_masks(layout, "block", 8, 3, seed=1)
    for worker in range(8):
        masks = plan.parameter_masks(model, worker)
        for k in range(layout.num_blocks):
            held = plan.holds_block(worker, k)
            for part in ("conv1", "norm1", "conv2", "norm2"):
                m = masks[f"blocks.{k}.{part}.weight"]
                assert bool(m.all()) == held and bool(m.any()) == held
        assert all(bool(m.all()) for n, m in masks.items() if "shortcut" in n or n.startswith(("embed", "head")))


@pytest.mark.parametrize("kind", ["neuron", "block"])
def test_parameter_masks_round_trip_through_validation(model, layout, kind):
    plan = assign_masks(layout, kind, 5, 2, seed=4)
    rebuilt = plan_from_parameter_masks(model, kind, 2, [plan.parameter_masks(model, w) for w in range(5)])
    assert rebuilt.channel_owners == plan.channel_owners and rebuilt.block_owners == plan.block_owners


def test_refuses_masks_that_break_the_invariant(model, layout):
    plan = assign_masks(layout, "block", 4, 2, seed=0)
    # a block with three owners
    owners = list(plan.block_owners)
    owners[0] = owners[0] | {next(w for w in range(4) if w not in owners[0])}
    with pytest.raises(MaskError, match="exactly P=2"):
        SubnetPlan("block", 4, 2, layout, tuple(owners),
                   tuple((o,) * layout.hidden_channels[k] for k, o in enumerate(owners)))
    # a hidden channel with one owner
    neuron = assign_masks(layout, "neuron", 4, 2, seed=0)
    rows = [list(r) for r in neuron.channel_owners]
    rows[2][5] = frozenset({0})
    with pytest.raises(MaskError, match="channel 5 is owned by 1 workers"):
        SubnetPlan("neuron", 4, 2, layout, neuron.block_owners, tuple(tuple(r) for r in rows))
    # P > N, P = 0, unknown kind, a worker index that does not exist
    for n, p in [(2, 3), (4, 0)]:
        with pytest.raises(MaskError, match="1 <= P <= N"):
            assign_masks(layout, "block", n, p)
    with pytest.raises(MaskError, match="unknown masking"):
        assign_masks(layout, "layer", 4, 2)
    owners = list(plan.block_owners)
    owners[1] = frozenset({0, 9})
    with pytest.raises(MaskError, match="not all workers"):
        SubnetPlan("block", 4, 2, layout, tuple(owners),
                   tuple((o,) * layout.hidden_channels[k] for k, o in enumerate(owners)))


def test_refuses_a_worker_with_every_path_dropped():
    # 4 blocks, N = 8, P = 1: four workers would own no residual branch at all.
    small = build_subnet_resnet(SubnetResNetConfig(in_channels=1, width=8, blocks_per_stage=(2, 2)))
    with pytest.raises(MaskError, match="owns no residual block"):
        assign_masks(small, "block", 8, 1)
    # first-stage hidden width 4: N = 8, P = 1 leaves four workers without a channel there.
    narrow = build_subnet_resnet(SubnetResNetConfig(in_channels=1, width=4, blocks_per_stage=(2, 2)))
    with pytest.raises(MaskError, match="owns no hidden channel"):
        assign_masks(narrow, "neuron", 8, 1)
    assign_masks(small, "block", 8, 2)  # 4 blocks x 2 owners covers all 8 workers


def test_refuses_inconsistent_parameter_masks(model, layout):
    plan = assign_masks(layout, "neuron", 4, 2, seed=0)
    masks = [plan.parameter_masks(model, w) for w in range(4)]
    broken = [dict(m) for m in masks]
    column = broken[0]["blocks.3.conv2.weight"].clone()
    dropped = int((~plan.channel_mask(0, 3)).nonzero()[0])
    column[:, dropped] = True  # conv2 reads a channel conv1 does not produce
    broken[0]["blocks.3.conv2.weight"] = column
    with pytest.raises(MaskError, match="Eq. 1-2"):
        plan_from_parameter_masks(model, "neuron", 2, broken)
    trunk = [dict(m) for m in masks]
    trunk[1]["embed.conv.weight"] = torch.zeros_like(trunk[1]["embed.conv.weight"])
    with pytest.raises(MaskError, match="trunk"):
        plan_from_parameter_masks(model, "neuron", 2, trunk)
    block = assign_masks(layout, "block", 4, 2, seed=0)
    partial = [dict(block.parameter_masks(model, w)) for w in range(4)]
    k = block.kept_blocks(0)[0]
    partial[0][f"blocks.{k}.norm2.weight"] = torch.zeros_like(partial[0][f"blocks.{k}.norm2.weight"])
    with pytest.raises(MaskError, match="in part"):
        plan_from_parameter_masks(model, "block", 2, partial)
    # masks that are well formed but owned by P + 1 workers
    with pytest.raises(MaskError, match="exactly P=1"):
        plan_from_parameter_masks(model, "neuron", 1, masks)


def test_refuses_models_it_cannot_mask():
    batchnorm = ResNet(ResNetConfig(in_channels=1, width=8, blocks_per_stage=(1, 1), norm="batch"))
    with pytest.raises(MaskError, match="GroupNorm"):
        assign_masks(batchnorm, "neuron", 2, 1)
    with pytest.raises(MaskError, match="no `blocks`"):
        assign_masks(torch.nn.Linear(3, 3), "block", 2, 1)


def _disjoint_pairs(plan):
    owners = plan.block_owners
    return [(j, k) for k in range(len(owners)) for j in range(k) if not owners[j] & owners[k]]


def test_balanced_block_owners_keep_blocks_apart_at_half_overlap(layout):
    """Why the default's unified model is out of distribution at P/N = 0.5 (N = 8, P = 4 and N = 4, P = 2):
    balancing whole blocks gives the first four branches one owner set disjoint from block 4's, and the
    last stage complementary owners -- no worker trains those branches together."""
    for n, p in ((8, 4), (4, 2)):
        for seed in range(3):
            plan = assign_masks(layout, "block", n, p, seed=seed)
            assert _disjoint_pairs(plan) == [(0, 4), (1, 4), (2, 4), (3, 4), (5, 7), (6, 7)], (n, p, seed)


def test_load_slack_mixes_block_owners_and_keeps_the_invariant(model, layout):
    total = sum(p.numel() for p in model.parameters())
    for slack in (0.0, 0.35, 1.0, 5.0):
        for n, p in PAIRS:
            plan = assign_masks(layout, "block", n, p, seed=n + p, load_slack=slack)  # validated: P owners, paths
            for name, count in owner_counts(plan, model).items():
                assert bool((count == (n if parameter_role(name, "block")[0] == "replicated" else p)).all())
            again = assign_masks(layout, "block", n, p, seed=n + p, load_slack=slack)
            assert again.fingerprint() == plan.fingerprint()
    for seed in range(5):
        plan = assign_masks(layout, "block", 8, 4, seed=seed, load_slack=0.35)
        # every pair of branches now shares an owner but the last stage's, which balance keeps apart
        # (holding both of its branches would put a worker at 0.76 of the model)
        assert _disjoint_pairs(plan) == [(6, 7)], seed
        loads = [plan.worker_parameter_count(model, w) / total for w in range(8)]
        assert 0.35 <= min(loads) and max(loads) <= 0.6, loads  # the price: a wider memory spread
    assert assign_masks(layout, "block", 8, 4, seed=0).fingerprint() != \
        assign_masks(layout, "block", 8, 4, seed=0, load_slack=0.35).fingerprint()


@pytest.mark.parametrize("kind,slack,match", [("neuron", 0.35, "block masking only"), ("block", -0.1, ">= 0"),
                                              ("block", True, ">= 0")])
def test_load_slack_refusals(layout, kind, slack, match):
    with pytest.raises(MaskError, match=match):
        assign_masks(layout, kind, 8, 4, load_slack=slack)
