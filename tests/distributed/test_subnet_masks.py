"""Subnetwork data parallelism: ownership masks (§3.1-3.2) -- coverage, reproducibility, refusals."""
from __future__ import annotations

import pytest
import torch

from edgetrain.methods.subnet_dp import (MaskError, ResNetLayout, SubnetPlan, assign_masks, owner_counts,
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
        trunk = plan.replicated_fraction(model)
        assert sum(fractions) / 4 == pytest.approx(0.5 + trunk / 2, abs=0.01)  # P/N of the branches on average
        if kind == "neuron":
            assert all(abs(f - 0.5 - trunk / 2) < 0.01 for f in fractions), fractions
        else:  # no worker above the memory cap: 1.2 x the balance-first heaviest (0.51 of the branches)
            assert max(fractions) <= 1.2 * 0.51 + trunk, fractions
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


def test_branches_apart_lists_pairs_with_no_common_owner(layout):
    owners = [frozenset({0, 1}), frozenset({2, 3}), frozenset({1, 2}), frozenset({0, 3}),
              frozenset({0, 1}), frozenset({0, 1}), frozenset({2, 3}), frozenset({0, 1})]
    plan = SubnetPlan("block", 4, 2, layout, tuple(owners), tuple((o,) * w for o, w in zip(owners, layout.hidden_channels)))
    assert plan.branches_apart() == [(0, 1), (2, 3), (1, 4), (1, 5), (0, 6), (4, 6), (5, 6), (1, 7), (6, 7)]
    sizes = layout.branch_parameters
    assert plan.branch_load(0) == pytest.approx(sum(sizes[k] for k in (0, 3, 4, 5, 7)) / sum(sizes))


def test_balance_first_block_owners_keep_blocks_apart_at_half_overlap(layout):
    """Why the unified model of a balance-first assignment is out of distribution at P/N = 0.5 (N = 8,
    P = 4 and N = 4, P = 2): whole blocks of ResNet-18's sizes give the first four branches one owner set
    disjoint from block 4's and the last stage complementary owners -- no worker trains those together.
    load_slack = 0 admits no worker above the balance-first heaviest, so the search keeps that shape."""
    for n, p in ((8, 4), (4, 2)):
        for seed in range(3):
            plan = assign_masks(layout, "block", n, p, seed=seed, load_slack=0.0)
            assert plan.branches_apart() == [(0, 4), (1, 4), (2, 4), (3, 4), (5, 7), (6, 7)], (n, p, seed)
            assert max(plan.branch_load(w) for w in range(n)) < 0.52


def test_default_block_owners_share_every_pair_but_the_last_stage_within_the_memory_cap(model, layout):
    """The default (load_slack 0.2) at N = 8, P = 4: every pair of branches has an owner in common but the
    last stage's (holding both would put a worker at 0.76 of the model), and no worker holds more than
    1.2 x the balance-first heaviest (0.51 of the branches here); the search needs only 0.54."""
    total = sum(p.numel() for p in model.parameters())
    for seed in range(6):
        plan = assign_masks(layout, "block", 8, 4, seed=seed)
        assert plan.branches_apart() == [(6, 7)], seed
        loads = [plan.branch_load(w) for w in range(8)]
        assert max(loads) <= 0.54 and min(loads) >= 0.46, loads
        assert sum(loads) == pytest.approx(4.0)  # P copies of every branch, whatever the spread
        assert len({plan.kept_blocks(w) for w in range(8)}) == 8  # eight different subnetworks
        params = [plan.worker_parameter_count(model, w) / total for w in range(8)]
        assert max(params) <= 0.54 + plan.replicated_fraction(model)
    # N = 4, P = 2 is tighter: the default needs 0.57 to keep only the last stage apart; a cap of 1.1x
    # leaves three pairs apart
    for seed in range(3):
        plan = assign_masks(layout, "block", 4, 2, seed=seed)
        assert plan.branches_apart() == [(6, 7)]
        assert max(plan.branch_load(w) for w in range(4)) <= 1.2 * 0.51
        assert len(assign_masks(layout, "block", 4, 2, seed=seed, load_slack=0.1).branches_apart()) == 3


def test_load_slack_keeps_the_invariant_and_is_reproducible(model, layout):
    for slack in (0.0, 5.0):  # the default (None) is covered by test_every_parameter_is_owned_by_exactly_p_workers
        for n, p in PAIRS[::3]:
            plan = assign_masks(layout, "block", n, p, seed=n + p, load_slack=slack)  # validated: P owners, paths
            for name, count in owner_counts(plan, model).items():
                assert bool((count == (n if parameter_role(name, "block")[0] == "replicated" else p)).all())
            again = assign_masks(layout, "block", n, p, seed=n + p, load_slack=slack)
            assert again.fingerprint() == plan.fingerprint()
    assert assign_masks(layout, "block", 8, 4, seed=0).fingerprint() == \
        assign_masks(layout, "block", 8, 4, seed=0, load_slack=0.2).fingerprint()  # None is the default 0.2
    assert assign_masks(layout, "block", 8, 4, seed=0, load_slack=0.0).fingerprint() != \
        assign_masks(layout, "block", 8, 4, seed=0).fingerprint()


def test_the_search_is_not_fooled_by_its_start(layout):
    """N = 4, P = 2 has 6^8 assignments; an exhaustive count in the test finds the fewest pairs apart
    under each cap, and the seeded search must reach it."""
    import itertools

    sizes, total = layout.branch_parameters, sum(layout.branch_parameters)
    pairs = list(itertools.combinations(range(4), 2))
    balanced = max(assign_masks(layout, "block", 4, 2, seed=0, load_slack=0.0).branch_load(w) for w in range(4))
    for slack in (0.05, 0.1, 0.2):
        cap = (1 + slack) * balanced * total
        fewest = None
        for combo in itertools.product(range(6), repeat=7):  # block 7's owners fixed to {0, 1} by symmetry
            owners = [set(pairs[c]) for c in combo] + [{0, 1}]
            loads = [sum(sizes[k] for k, o in enumerate(owners) if w in o) for w in range(4)]
            if max(loads) <= cap + 1e-9 and all(loads):
                apart = sum(not owners[j] & owners[k] for k in range(8) for j in range(k))
                fewest = apart if fewest is None else min(fewest, apart)
        found = assign_masks(layout, "block", 4, 2, seed=1, load_slack=slack)
        assert len(found.branches_apart()) == fewest, slack
        assert max(found.branch_load(w) for w in range(4)) * total <= cap + 1e-9


@pytest.mark.parametrize("kind,slack,match", [("neuron", 0.35, "block masking only"), ("block", -0.1, ">= 0"),
                                              ("block", True, ">= 0")])
def test_load_slack_refusals(layout, kind, slack, match):
    with pytest.raises(MaskError, match=match):
        assign_masks(layout, kind, 8, 4, load_slack=slack)
