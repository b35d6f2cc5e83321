"""`assign_masks`: the reproducible ownership plan for neuron or block masking of N workers, overlap P.

Neuron masking: hidden channels are dealt round-robin to a seeded ring of workers, P consecutive
workers per channel, the count carried from channel to channel (and the window moved on by one after
each full period when gcd(N, P) > 1, so no two workers get identical channel sets). Channels are dealt
group by group of norm1's GroupNorm, so every worker gets (about) channels * P / N channels of each
group and its norm statistics cover only active channels; owner sets are windows of the ring (at most
N distinct sets, hence at most N process groups for the collectives).

Block masking: residual branches differ in size, and what is evaluated is the unified model, every
branch at once. Owners that balance memory first (largest block to the P lightest workers) keep some
pairs of branches apart, so that no worker ever trains them together, and the unified model, which
runs them together, is out of distribution. So block owners come from a seeded local search under a
memory cap: no worker may hold more than (1 + load_slack) times the heaviest worker of the
balance-first assignment (relative to what whole blocks allow, not to P/N itself). Within the cap the
search minimises, in order: the pairs of branches that share no owner, the heaviest worker's load, the
pairs of workers holding identical subnetworks, and the spread of per-worker load. It starts from the
balance-first assignment and hands one block from an owner to a non-owner at a time (the block keeps
its P owners). load_slack = 0 allows no worker above the balance-first heaviest. What the cap costs
and buys in accuracy is measured in docs/methods/subnet-dp.md ("Block owners under a memory cap").
"""
from __future__ import annotations

import math
import random
from typing import Sequence

import torch
from torch import nn

from edgetrain.methods.subnet_dp.layout import MASKINGS, MaskError, ResNetLayout
from edgetrain.methods.subnet_dp.plan import SubnetPlan

DEFAULT_LOAD_SLACK = 0.2  # block masking: no worker above 1.2 x the balance-first heaviest
_SEARCH_RESTARTS = 3
_SEARCH_STEPS = 1500       # swaps tried per restart (how soon it settles: docs/methods/subnet-dp.md)


def _ring(num_workers: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(num_workers, generator=generator).tolist()


def assign_masks(layout: ResNetLayout | nn.Module, kind: str, num_workers: int, overlap: int,
                 seed: int = 0, load_slack: float | None = None) -> SubnetPlan:
    """The reproducible ownership plan for `kind` masking of N = num_workers, P = overlap (see module doc).

    load_slack (block masking only): a worker may hold at most (1 + load_slack) * P/N of the branch
    parameters; None means DEFAULT_LOAD_SLACK. Within that cap the block owners are the ones that leave
    the fewest pairs of branches with no common owner (trained together by no worker)."""
    if isinstance(layout, nn.Module):
        layout = ResNetLayout.of(layout)
    if kind not in MASKINGS:
        raise MaskError(f"unknown masking {kind!r}; known: {', '.join(MASKINGS)}")
    n, p = num_workers, overlap
    if not (isinstance(n, int) and isinstance(p, int) and 1 <= p <= n):
        raise MaskError(f"need integers 1 <= P <= N, got N={n!r}, P={p!r}")
    if load_slack is not None:
        if kind != "block":
            raise MaskError("load_slack applies to block masking only (neuron masking deals channels evenly)")
        if isinstance(load_slack, bool) or not isinstance(load_slack, (int, float)) or not load_slack >= 0:
            raise MaskError(f"load_slack must be a number >= 0 (a fraction of a worker's P/N share), "
                            f"got {load_slack!r}")
    ring = _ring(n, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    dealt = 0
    common = math.gcd(n, p)
    period = n // common  # units that cover the ring p / common times

    def deal() -> frozenset[int]:
        # Window j starts at j * P, moved on by one after every full period when gcd(N, P) > 1:
        # otherwise windows would start only at multiples of the gcd and, e.g. for N = 4, P = 2, workers
        # would pair up into identical subnetworks. Each period still covers every worker equally.
        nonlocal dealt
        start = dealt * p + (dealt // period if common > 1 else 0)
        dealt += 1
        return frozenset(ring[(start + t) % n] for t in range(p))

    everyone = frozenset(range(n))
    if kind == "block":
        start = _balanced_block_owners(layout, n, p, generator)
        block_owners = _search_block_owners(layout, n, p, start, DEFAULT_LOAD_SLACK if load_slack is None
                                            else float(load_slack), seed)
        channel_owners = tuple((block_owners[k],) * layout.hidden_channels[k] for k in range(layout.num_blocks))
    else:
        block_owners = (everyone,) * layout.num_blocks
        rows = []
        for width in layout.hidden_channels:
            per_group = width // layout.num_groups
            row: list[frozenset[int]] = [everyone] * width
            for g in range(layout.num_groups):
                for c in (g * per_group + torch.randperm(per_group, generator=generator)).tolist():
                    row[c] = deal()
            rows.append(tuple(row))
        channel_owners = tuple(rows)
    return SubnetPlan(kind, n, p, layout, block_owners, channel_owners, seed=seed)


def _balanced_block_owners(layout: ResNetLayout, n: int, p: int,
                           generator: torch.Generator) -> list[frozenset[int]]:
    """Balance first: blocks largest first to the P workers holding the fewest parameters so far; among
    workers within half a block of the lightest, those that shared the fewest blocks with the ones
    already chosen (so the N subnetworks differ), ties in a seeded order."""
    order = torch.randperm(layout.num_blocks, generator=generator).tolist()
    order.sort(key=lambda k: -layout.branch_parameters[k])  # stable: seeded order among equal sizes
    load = [0] * n
    together = [[0] * n for _ in range(n)]
    owners: list[frozenset[int]] = [frozenset()] * layout.num_blocks
    for k in order:
        size = layout.branch_parameters[k]
        tie = torch.randperm(n, generator=generator).tolist()
        chosen: list[int] = []
        for _ in range(p):
            rest = [w for w in range(n) if w not in chosen]
            lightest = min(load[w] for w in rest)
            candidates = [w for w in rest if load[w] <= lightest + size // 2]
            chosen.append(min(candidates, key=lambda w: (sum(together[w][c] for c in chosen), load[w], tie[w])))
        for a in chosen:
            load[a] += size
            for b in chosen:
                together[a][b] += a != b
        owners[k] = frozenset(chosen)
    return owners


def _search_block_owners(layout: ResNetLayout, n: int, p: int, start: Sequence[frozenset[int]],
                         load_slack: float, seed: int) -> tuple[frozenset[int], ...]:
    """Seeded local search over block owners (see module doc). The score, compared lexicographically:
    (workers holding no block, load above the cap, pairs of branches with no common owner, the
    heaviest worker's load, pairs of workers with identical blocks, max - min load). A move hands one
    block from an owner to a non-owner; moves that do not worsen the score are kept (plateaus are
    walked), a worse one 1% of the time; the best assignment seen is returned."""
    sizes = layout.branch_parameters
    blocks = layout.num_blocks

    if p == n:
        return tuple(frozenset(range(n)) for _ in range(blocks))
    pairs = [(j, k) for k in range(blocks) for j in range(k)]
    rng = random.Random(f"subnet-block-owners/{seed}")

    def loads_and_holdings(owners: list[int]) -> tuple[list[int], list[int]]:
        load, held = [0] * n, [0] * n  # held: bit k set when the worker holds block k
        for k, members in enumerate(owners):
            for w in range(n):
                if members >> w & 1:
                    load[w] += sizes[k]
                    held[w] |= 1 << k
        return load, held

    initial = [sum(1 << w for w in members) for members in start]
    # The cap is relative to the balance-first assignment's heaviest worker, not to P/N itself: whole
    # blocks may not allow P/N (one large branch alone can hold more than P/N of the branches).
    cap = (1.0 + load_slack) * max(loads_and_holdings(initial)[0])

    def score(owners: list[int]) -> tuple:
        load, held = loads_and_holdings(owners)
        return (sum(h == 0 for h in held), max(0.0, max(load) - cap),
                sum(not owners[j] & owners[k] for j, k in pairs),
                max(load), len(held) - len(set(held)), max(load) - min(load))

    best_owners, best = list(initial), score(initial)
    for _ in range(_SEARCH_RESTARTS):
        owners, current = list(initial), score(initial)
        for _ in range(_SEARCH_STEPS):
            k = rng.randrange(blocks)
            inside = [w for w in range(n) if owners[k] >> w & 1]
            outside = [w for w in range(n) if not owners[k] >> w & 1]
            before = owners[k]
            owners[k] = before & ~(1 << rng.choice(inside)) | (1 << rng.choice(outside))
            candidate = score(owners)
            if candidate <= current or rng.random() < 0.01:
                current = candidate
                if current < best:
                    best, best_owners = current, list(owners)
            else:
                owners[k] = before
    return tuple(frozenset(w for w in range(n) if members >> w & 1) for members in best_owners)
