"""Ownership masks of subnetwork data parallelism (Singh et al. 2025, §3.1-3.2) for residual networks.

N workers, overlap P <= N. The *maskable units* are split among the workers so that every unit is
owned by exactly P of them (sum_i m_i = P * 1), fixed for the run and reproducible from a seed:

  neuron masking -- a unit is one hidden channel of a residual branch: output channel c of
      `blocks.k.conv1` (Eq. 1: its weight row and, through norm1, its affine pair) together with input
      channel c of `blocks.k.conv2` (Eq. 2: its weight column). One index list per (worker, block)
      slices all four tensors, so the output mask of layer l and the input mask of layer l+1 agree
      by construction. Channels are dealt out group by group of norm1's GroupNorm, so a worker keeps
      (almost) the same number of channels in each group and its norm statistics cover only active
      channels (§4).
  block masking -- a unit is one residual branch, `blocks.k.{conv1, norm1, conv2, norm2}`. A worker
      that does not own block k computes relu(shortcut(h)) there, Eq. 3's z * B(h) + h with z = 0
      (relu(h) = h for the post-ReLU hidden state; a stage's first block keeps its projection
      shortcut, the only way to change the shape).

Replicated trunk. A worker's subnetwork needs a path from input to loss, so the stem (`embed.*`),
the classifier (`head.*`), the projection shortcuts (`blocks.k.shortcut.*`) and, under neuron
masking, the residual stream's norms (`blocks.k.norm2.*`, whose channels are the stream's) are held
by all N workers and averaged over N -- plain data parallelism. With P < N no assignment could give
them P owners: a parameter W[r, c] of a dense layer is held by the workers owning both row r and
column c, and "exactly P for every (r, c)" forces one owner set for every unit of the chain. The
trunk is 1.6% of ResNet-18's parameters (`SubnetPlan.replicated_fraction`); the invariant
sum_i m_i = P holds on every other parameter entry, sum_i m_i = N on the trunk, and both are checked.

Assignment. Hidden channels are dealt round-robin to a seeded ring of workers, P consecutive workers
per channel, the count carried from channel to channel (and the window moved on by one after each
full period when gcd(N, P) > 1, so no two workers get identical channel sets): every worker gets
(about) channels * P / N channels of each norm group, and the owner sets are windows of the ring (at
most N distinct sets, hence at most N process groups for the collectives).

Blocks differ in size (a late stage's branch is ~4x an early one's, ResNet-18's last stage holds ~75%
of its branch parameters), and what is evaluated is the unified model: every branch at once. A
balance-first assignment (largest block first to the P lightest workers) has a cost there. On the
digits ResNet at P/N = 0.5 it gives, at every seed, the first four branches one owner set disjoint
from block 4's: no worker ever trains block 4 on features the first two stages have processed, and
the unified model, which runs them together, is out of distribution (digits, N = 8, seeds 0-4:
7.8-25.4 points below DP; N = 4, seeds 0-4: 5.3-16.7). So block owners come from a seeded local search
under a memory cap: no worker may hold more than (1 + load_slack) times the heaviest worker of the
balance-first assignment (the cap is relative to what whole blocks allow, not to P/N itself:
ResNet-18's last branch alone is 0.43 of the branches, above P/N = 0.375). The default load_slack
0.2 caps the digits ResNet at 0.61 of the branches at P/N = 0.5. Within the cap the search
minimises, in order: the pairs of branches that share no owner (no worker trains them together),
the heaviest worker's load, the pairs of workers holding identical subnetworks, and the spread of
per-worker load. It starts from the balance-first assignment and hands one block from an owner to a
non-owner at a time (the block keeps its P owners). load_slack = 0 allows no worker above the
balance-first heaviest.

What this costs and buys in accuracy (digits, several seeds, N = 4 and 8) is measured in
docs/methods/subnet-dp.md ("Block owners under a memory cap").
"""
from __future__ import annotations

import hashlib
import math
import random
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import torch
from torch import nn

from edgetrain.registry import EdgetrainError

MASKINGS = ("neuron", "block")
_BRANCH = re.compile(r"^blocks\.(\d+)\.(conv1|norm1|conv2|norm2)\.(weight|bias)$")


class MaskError(EdgetrainError, ValueError):
    """A mask assignment that breaks the ownership invariant or leaves a worker without a path."""


@dataclass(frozen=True)
class ResNetLayout:
    """What the masks need to know about the model: each residual branch's hidden width, the groups of
    its GroupNorm, and the parameter count of each branch (for balancing block ownership)."""
    hidden_channels: tuple[int, ...]
    num_groups: int
    branch_parameters: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.hidden_channels:
            raise MaskError("the model has no residual blocks to mask")
        if len(self.branch_parameters) != len(self.hidden_channels):
            raise MaskError("branch_parameters needs one count per block")
        for k, width in enumerate(self.hidden_channels):
            if width % self.num_groups:
                raise MaskError(f"block {k}: {width} hidden channels do not split into {self.num_groups} groups")

    @property
    def num_blocks(self) -> int:
        return len(self.hidden_channels)

    @classmethod
    def of(cls, model: nn.Module) -> "ResNetLayout":
        """Read off a ResNet with the block view whose blocks have conv1/norm1/conv2/norm2 (GroupNorm)."""
        blocks = getattr(model, "blocks", None)
        if blocks is None or not len(blocks):
            raise MaskError(f"{type(model).__name__} has no `blocks`: subnetwork masks need a residual network")
        widths, groups, sizes = [], set(), []
        for k, block in enumerate(blocks):
            for part in ("conv1", "norm1", "conv2", "norm2", "shortcut"):
                if not hasattr(block, part):
                    raise MaskError(f"blocks.{k} ({type(block).__name__}) has no {part}: subnetwork masks need "
                                    "BasicBlocks (conv1, norm1, conv2, norm2, shortcut)")
            if not isinstance(block.norm1, nn.GroupNorm):
                raise MaskError(f"blocks.{k}.norm1 is {type(block.norm1).__name__}; subnetwork data parallelism "
                                "needs GroupNorm (norm='group'): statistics over active channels, no running stats")
            widths.append(block.conv1.out_channels)
            groups.add(block.norm1.num_groups)
            sizes.append(sum(p.numel() for part in ("conv1", "norm1", "conv2", "norm2")
                             for p in getattr(block, part).parameters()))
        if len(groups) != 1:
            raise MaskError(f"blocks use different GroupNorm group counts {sorted(groups)}")
        return cls(tuple(widths), groups.pop(), tuple(sizes))


def parameter_role(name: str, kind: str) -> tuple[str, int | None, int | None]:
    """(role, block, dim) of a full-model parameter under `kind` masking.

    roles: "replicated" (all N workers), "branch" (block masking: the whole tensor follows block k),
    "hidden" (neuron masking: slice dimension `dim` of the tensor follows block k's hidden channels).
    """
    match = _BRANCH.match(name)
    if match is None:
        return "replicated", None, None
    block, part, leaf = int(match.group(1)), match.group(2), match.group(3)
    if kind == "block":
        return "branch", block, None
    if part in ("conv1", "norm1"):
        return "hidden", block, 0
    if part == "conv2" and leaf == "weight":
        return "hidden", block, 1
    return "replicated", None, None  # conv2 bias and norm2 act on the residual stream's channels


@dataclass(frozen=True)
class SubnetPlan:
    """Who owns what, for N workers with overlap P; validated on construction.

    block_owners[k]: the workers holding residual branch k (all N under neuron masking).
    channel_owners[k][c]: the workers holding hidden channel c of block k (under block masking, the
    owners of the block itself).
    """
    kind: str
    num_workers: int
    overlap: int
    layout: ResNetLayout
    block_owners: tuple[frozenset[int], ...]
    channel_owners: tuple[tuple[frozenset[int], ...], ...]
    seed: int | None = None
    _cache: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        validate_plan(self)

    # -- one worker's view ---------------------------------------------------------------------
    def holds_block(self, worker: int, block: int) -> bool:
        return worker in self.block_owners[block]

    def kept_blocks(self, worker: int) -> tuple[int, ...]:
        return tuple(k for k in range(self.layout.num_blocks) if self.holds_block(worker, k))

    def kept_channels(self, worker: int, block: int) -> tuple[int, ...]:
        """Sorted hidden channels of `block` that `worker` holds (all of a held block's under block masking;
        none of a dropped one)."""
        key = ("channels", worker, block)
        if key not in self._cache:
            self._cache[key] = tuple(c for c, owners in enumerate(self.channel_owners[block]) if worker in owners)
        return self._cache[key]

    def channel_mask(self, worker: int, block: int) -> torch.Tensor:
        mask = torch.zeros(self.layout.hidden_channels[block], dtype=torch.bool)
        mask[list(self.kept_channels(worker, block))] = True
        return mask

    def group_sizes(self, worker: int, block: int) -> tuple[int, ...]:
        """Kept channels of `worker` in each GroupNorm group of block's norm1."""
        per_group = self.layout.hidden_channels[block] // self.layout.num_groups
        kept = self.kept_channels(worker, block)
        return tuple(sum(1 for c in kept if c // per_group == g) for g in range(self.layout.num_groups))

    # -- parameters in full-model coordinates ---------------------------------------------------
    def slice_of(self, name: str, worker: int) -> tuple[str, int | None, tuple[int, ...] | None]:
        """How `worker` holds full parameter `name`: ("all", None, None), ("none", None, None) or
        ("rows", dim, indices): the listed indices along dimension `dim`."""
        role, block, dim = parameter_role(name, self.kind)
        if role == "replicated":
            return "all", None, None
        if role == "branch":
            return ("all" if self.holds_block(worker, block) else "none"), None, None
        return "rows", dim, self.kept_channels(worker, block)

    def owner_count(self, name: str) -> int:
        """Workers holding each entry of `name`: P for masked parameters, N for the replicated trunk."""
        return self.num_workers if parameter_role(name, self.kind)[0] == "replicated" else self.overlap

    def parameter_mask(self, name: str, shape: Sequence[int], worker: int) -> torch.Tensor:
        """m_i restricted to parameter `name` (bool, the full shape)."""
        how, dim, indices = self.slice_of(name, worker)
        if how == "all":
            return torch.ones(tuple(shape), dtype=torch.bool)
        mask = torch.zeros(tuple(shape), dtype=torch.bool)
        if how == "rows":
            index = [slice(None)] * len(shape)
            index[dim] = list(indices)  # type: ignore[index]
            mask[tuple(index)] = True
        return mask

    def parameter_masks(self, model: nn.Module, worker: int) -> dict[str, torch.Tensor]:
        return {name: self.parameter_mask(name, p.shape, worker) for name, p in model.named_parameters()}

    def worker_parameter_count(self, model: nn.Module, worker: int) -> int:
        """Parameters `worker` materialises (counted from the plan, for checking measured bytes)."""
        total = 0
        for name, p in model.named_parameters():
            how, dim, indices = self.slice_of(name, worker)
            if how == "all":
                total += p.numel()
            elif how == "rows":
                total += p.numel() // p.shape[dim] * len(indices)  # type: ignore[arg-type]
        return total

    def branch_load(self, worker: int) -> float:
        """The fraction of all residual-branch parameters `worker` holds (P/N under neuron masking, up to
        rounding; the memory cap bounds it under block masking)."""
        sizes = self.layout.branch_parameters
        held = sum(sizes[k] * len(self.kept_channels(worker, k)) / self.layout.hidden_channels[k]
                   for k in range(self.layout.num_blocks))
        return held / sum(sizes)

    def branches_apart(self) -> list[tuple[int, int]]:
        """Pairs of residual branches (j < k) that no worker holds together: combinations only the unified
        model runs."""
        owners = self.block_owners
        return [(j, k) for k in range(len(owners)) for j in range(k) if not owners[j] & owners[k]]

    def replicated_fraction(self, model: nn.Module) -> float:
        total = sum(p.numel() for p in model.parameters())
        trunk = sum(p.numel() for n, p in model.named_parameters() if parameter_role(n, self.kind)[0] == "replicated")
        return trunk / total

    def owner_sets(self) -> tuple[frozenset[int], ...]:
        """The distinct owner sets of the maskable units, in a canonical order every rank agrees on."""
        sets = {owners for row in self.channel_owners for owners in row} | set(self.block_owners)
        sets = {s for s in sets if len(s) == self.overlap}
        return tuple(sorted(sets, key=lambda s: (len(s), sorted(s))))

    def fingerprint(self) -> str:
        """A short hash of the assignment, for checking that every rank built the same plan."""
        text = repr((self.kind, self.num_workers, self.overlap, self.layout,
                     [sorted(s) for s in self.block_owners],
                     [[sorted(s) for s in row] for row in self.channel_owners]))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        ratio = self.overlap / self.num_workers
        lines = [f"{self.kind} masking, N={self.num_workers}, P={self.overlap} (P/N={ratio:.3f})"]
        for worker in range(self.num_workers):
            if self.kind == "block":
                lines.append(f"  worker {worker}: blocks {list(self.kept_blocks(worker))}, "
                             f"{self.branch_load(worker):.3f} of the branch parameters")
            else:
                counts = [len(self.kept_channels(worker, k)) for k in range(self.layout.num_blocks)]
                widths = list(self.layout.hidden_channels)
                lines.append(f"  worker {worker}: hidden channels per block {counts} of {widths}")
        if self.kind == "block":
            lines.append(f"  branches no worker holds together: {self.branches_apart() or 'none'}")
        return "\n".join(lines)


def validate_plan(plan: SubnetPlan) -> None:
    """Refuse a plan that breaks sum_i m_i = P * 1 or gives some worker no path through the residual
    branches (every branch dropped under block masking, a branch with no channel under neuron masking)."""
    n, p, layout = plan.num_workers, plan.overlap, plan.layout
    if plan.kind not in MASKINGS:
        raise MaskError(f"unknown masking {plan.kind!r}; known: {', '.join(MASKINGS)}")
    if not (isinstance(n, int) and isinstance(p, int) and 1 <= p <= n):
        raise MaskError(f"need integers 1 <= P <= N, got N={n!r}, P={p!r}")
    everyone = frozenset(range(n))
    if len(plan.block_owners) != layout.num_blocks or len(plan.channel_owners) != layout.num_blocks:
        raise MaskError(f"the plan covers {len(plan.block_owners)} blocks; the model has {layout.num_blocks}")
    for k, (block_owners, row) in enumerate(zip(plan.block_owners, plan.channel_owners)):
        if not block_owners <= everyone:
            raise MaskError(f"block {k}: owners {sorted(block_owners)} are not all workers 0..{n - 1}")
        if len(row) != layout.hidden_channels[k]:
            raise MaskError(f"block {k}: {len(row)} channel owner sets for {layout.hidden_channels[k]} channels")
        for c, owners in enumerate(row):
            if not owners <= everyone:
                raise MaskError(f"block {k} channel {c}: owners {sorted(owners)} are not all workers 0..{n - 1}")
        if plan.kind == "block":
            if len(block_owners) != p:
                raise MaskError(f"block {k} is owned by {len(block_owners)} workers {sorted(block_owners)}; every "
                                f"parameter must be owned by exactly P={p} (sum_i m_i = P)")
            bad = [c for c, owners in enumerate(row) if owners != block_owners]
            if bad:
                raise MaskError(f"block masking keeps or drops block {k} whole, but channels {bad[:5]} have other "
                                "owners than the block")
        else:
            if block_owners != everyone:
                raise MaskError(f"neuron masking keeps every block on every worker; block {k} has owners "
                                f"{sorted(block_owners)}")
            bad = [c for c, owners in enumerate(row) if len(owners) != p]
            if bad:
                c = bad[0]
                raise MaskError(f"block {k} hidden channel {c} is owned by {len(row[c])} workers; every parameter "
                                f"must be owned by exactly P={p} (sum_i m_i = P)")
    for worker in range(n):
        if plan.kind == "block" and not plan.kept_blocks(worker):
            raise MaskError(f"worker {worker} owns no residual block: every path through the network's blocks is "
                            f"dropped (block masking needs blocks * P >= N; here {layout.num_blocks} * {p} vs {n})")
        if plan.kind == "neuron":
            empty = [k for k in range(layout.num_blocks) if not plan.kept_channels(worker, k)]
            if empty:
                raise MaskError(f"worker {worker} owns no hidden channel of block(s) {empty}: that residual branch "
                                "is dropped entirely, which is block masking; neuron masking needs "
                                f"hidden channels * P >= N in every block")


DEFAULT_LOAD_SLACK = 0.2  # block masking: no worker above 1.2 x the balance-first heaviest
_SEARCH_RESTARTS = 3
_SEARCH_STEPS = 1500       # swaps tried per restart; the digits ResNet settles within a few hundred


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
    # blocks may not allow P/N (ResNet-18's last branch alone is 0.43 of the branches, above 0.375).
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


def plan_from_parameter_masks(model: nn.Module, kind: str, overlap: int,
                              masks: Sequence[Mapping[str, torch.Tensor]]) -> SubnetPlan:
    """A plan from explicit full-coordinate parameter masks m_i (one dict per worker), refusing masks
    that are not structured the way `kind` masking is: a trunk parameter not held whole by everyone,
    a block held in part, conv1's output mask disagreeing with norm1's or with conv2's input mask
    (Eq. 1-2), or an entry whose owner count is not P."""
    layout = ResNetLayout.of(model)
    n = len(masks)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    for worker, m in enumerate(masks):
        missing = set(shapes) - set(m)
        if missing:
            raise MaskError(f"worker {worker}: no mask for {sorted(missing)[:3]}")
        for name, shape in shapes.items():
            if tuple(m[name].shape) != shape:
                raise MaskError(f"worker {worker}: mask of {name} has shape {tuple(m[name].shape)}, parameter {shape}")

    def owners_of(predicate) -> frozenset[int]:
        return frozenset(w for w in range(n) if predicate(masks[w]))

    for name in shapes:
        if parameter_role(name, kind)[0] == "replicated":
            partial = [w for w in range(n) if not bool(masks[w][name].all())]
            if partial:
                raise MaskError(f"{name} is part of the trunk every worker needs for a path from input to loss; "
                                f"worker(s) {partial} mask it")
    block_owners, channel_owners = [], []
    for k in range(layout.num_blocks):
        prefix = f"blocks.{k}."
        names = [nm for nm in shapes if parameter_role(nm, kind)[1] == k]
        if kind == "block":
            for w in range(n):
                held = {bool(masks[w][nm].all()) for nm in names} | {bool(masks[w][nm].any()) for nm in names}
                if len(held) != 1:
                    raise MaskError(f"worker {w} holds block {k} in part; block masking keeps or drops a branch whole")
            owners = owners_of(lambda m: bool(m[prefix + "conv1.weight"].all()))
            block_owners.append(owners)
            channel_owners.append((owners,) * layout.hidden_channels[k])
            continue
        block_owners.append(frozenset(range(n)))
        row = []
        for c in range(layout.hidden_channels[k]):
            per_worker = []
            for w in range(n):
                m = masks[w]
                views = [m[prefix + "conv1.weight"][c], m[prefix + "norm1.weight"][c], m[prefix + "norm1.bias"][c],
                         m[prefix + "conv2.weight"][:, c]]
                if (prefix + "conv1.bias") in m:
                    views.append(m[prefix + "conv1.bias"][c])
                states = {bool(v.all()) for v in views} | {bool(v.any()) for v in views}
                if len(states) != 1:
                    raise MaskError(f"worker {w}, block {k}, hidden channel {c}: conv1's output row, norm1 and "
                                    "conv2's input column must be kept or dropped together (Eq. 1-2)")
                per_worker.append(bool(views[0].all()))
            row.append(frozenset(w for w in range(n) if per_worker[w]))
        channel_owners.append(tuple(row))
    return SubnetPlan(kind, n, overlap, layout, tuple(block_owners), tuple(channel_owners))


def owner_counts(plan: SubnetPlan, model: nn.Module) -> dict[str, torch.Tensor]:
    """sum_i m_i per parameter entry (int, full shape) -- P on masked parameters, N on the trunk."""
    counts = {name: torch.zeros(p.shape, dtype=torch.int32) for name, p in model.named_parameters()}
    for worker in range(plan.num_workers):
        for name, mask in plan.parameter_masks(model, worker).items():
            counts[name] += mask.to(torch.int32)
    return counts


def masked_and_replicated(plan: SubnetPlan, names: Iterable[str]) -> tuple[list[str], list[str]]:
    masked, replicated = [], []
    for name in names:
        (replicated if parameter_role(name, plan.kind)[0] == "replicated" else masked).append(name)
    return masked, replicated
