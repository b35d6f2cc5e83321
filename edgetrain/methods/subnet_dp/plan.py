"""`SubnetPlan`: who owns what, for N workers with overlap P, and its validation.

Every maskable entry is owned by exactly P workers (sum_i m_i = P), the replicated trunk by all N
(layout.py); `validate_plan` refuses any plan that breaks this or leaves a worker without a path
through the residual branches. One worker's view (kept blocks, kept channels, parameter masks and
slices in full-model coordinates) is read off the plan.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from torch import nn

from edgetrain.methods.subnet_dp.layout import MASKINGS, MaskError, ResNetLayout, parameter_role

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
