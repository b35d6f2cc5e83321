"""Masked gradient averaging (§3.1): g_bar = sum_i m_i * g_i / sum_i m_i, over torch.distributed.

Every entry is divided by its owner count from the plan -- P for masked parameters, N for the
replicated trunk -- never by the number of workers whose gradient happened to be non-zero: a worker
whose ReLUs are dead on its batch sends zeros, and those zeros are part of the average.

Two engines, one result (tested equal):

  "groups" (default) -- one process group per distinct owner set (at most N of them for neuron
      masking, at most one per block for block masking) plus the world group for the trunk. A worker
      packs the gradient slices it shares with each owner set into one flat buffer, all-reduces it in
      that group and divides by P. It sends only its own subnetwork's gradients: about P/N of a
      DP all-reduce.
  "dense" -- the reference: every parameter's gradient is scattered into full coordinates (zeros
      where the worker does not own it), all-reduced over all workers and divided by the owner count.
      Full-model-size buffers and traffic, like DP.

Groups are visited in one canonical order on every rank (the world group first, then the plan's
owner sets), so the blocking collectives of overlapping groups cannot deadlock.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from edgetrain.methods.subnet_dp.layout import parameter_role
from edgetrain.methods.subnet_dp.plan import SubnetPlan
from edgetrain.methods.subnet_dp.subnetwork import Subnetwork
from edgetrain.registry import EdgetrainError


class AveragingError(EdgetrainError, ValueError):
    """A request the averager cannot serve: an unknown engine, gradients for another worker count."""


class ProcessGroupError(EdgetrainError, RuntimeError):
    """The processes do not match the plan: no process group, or a rank holding another plan's subnetwork."""

ENGINES = ("groups", "dense")


def average_masked_gradients(grads: Sequence[Mapping[str, torch.Tensor]], plan: SubnetPlan,
                             shapes: Mapping[str, Sequence[int]]) -> dict[str, torch.Tensor]:
    """Single-process reference of Eq. (§3.1): grads[i][name] is worker i's gradient in full coordinates
    (entries outside m_i are ignored, as if zero); returns sum_i m_i * g_i / (owner count)."""
    if len(grads) != plan.num_workers:
        raise AveragingError(f"{len(grads)} gradients for {plan.num_workers} workers")
    out = {}
    for name, shape in shapes.items():
        total = torch.zeros(tuple(shape), dtype=grads[0][name].dtype, device=grads[0][name].device)
        for worker, g in enumerate(grads):
            total += g[name] * plan.parameter_mask(name, shape, worker).to(g[name].device, g[name].dtype)
        out[name] = total / plan.owner_count(name)
    return out


@dataclass
class _Piece:
    """A slice of one subnetwork parameter that goes into a bucket: whole (dim None) or `index` along `dim`."""
    param: torch.nn.Parameter
    dim: int | None = None
    index: torch.Tensor | None = None

    def read(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.dim is None else tensor.index_select(self.dim, self.index)

    def write(self, tensor: torch.Tensor, value: torch.Tensor) -> None:
        if self.dim is None:
            tensor.copy_(value.view_as(tensor))
        else:
            shape = list(tensor.shape)
            shape[self.dim] = len(self.index)
            tensor.index_copy_(self.dim, self.index, value.view(shape))

    def numel(self) -> int:
        if self.dim is None:
            return self.param.numel()
        return self.param.numel() // self.param.shape[self.dim] * len(self.index)


@dataclass
class _Bucket:
    owners: tuple[int, ...]
    divisor: int
    group: object | None  # a ProcessGroup, dist.group.WORLD, or None (a set of one: nothing to send)
    pieces: list[_Piece] = field(default_factory=list)

    def numel(self) -> int:
        return sum(piece.numel() for piece in self.pieces)


def _ring_wire_bytes(payload: int, members: int) -> int:
    """Bytes one rank sends in a ring all-reduce of `payload` bytes among `members` ranks."""
    return 0 if members <= 1 else int(2 * (members - 1) / members * payload)


class MaskedAverager:
    """Averages a subnetwork's .grad over exactly the owners of each entry (see the module doc).

    Must be constructed on every rank in the same order (it creates process groups). `stats` after
    each average(): payload bytes handed to collectives, and the bytes a ring all-reduce sends."""

    def __init__(self, subnet: Subnetwork, engine: str = "groups") -> None:
        if engine not in ENGINES:
            raise AveragingError(f"unknown averaging engine {engine!r}; known: {', '.join(ENGINES)}")
        if not dist.is_initialized():
            raise ProcessGroupError("MaskedAverager needs torch.distributed initialised (torchrun, init_process_group)")
        self.subnet, self.plan, self.engine = subnet, subnet.plan, engine
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world != self.plan.num_workers or self.rank != subnet.worker:
            raise ProcessGroupError(f"rank {self.rank} of {self.world} holds worker {subnet.worker}'s subnetwork of a "
                               f"plan for {self.plan.num_workers} workers; rank and worker must agree")
        self.params = dict(subnet.named_parameters())
        self.stats = {"payload_bytes": 0, "wire_bytes": 0, "collectives": 0}
        self.buckets = self._build_buckets()  # the dense engine does not use them; owner_discrepancy does

    # -- bucket layout ----------------------------------------------------------------------------
    def _build_buckets(self) -> list[_Bucket]:
        plan, worker, params = self.plan, self.rank, self.params
        everyone = tuple(range(self.world))
        trunk = _Bucket(everyone, self.world, dist.group.WORLD)
        buckets = [trunk]
        by_owners: dict[frozenset[int], _Bucket] = {}
        for owners in plan.owner_sets():
            members = tuple(sorted(owners))
            if len(members) == self.world:
                group = dist.group.WORLD
            else:
                group = dist.new_group(ranks=list(members))  # every rank calls this, members or not
                if worker not in owners:
                    group = None
            by_owners[owners] = _Bucket(members, plan.overlap, group if len(members) > 1 else None)
            buckets.append(by_owners[owners])
        for name, param in params.items():
            role, block, dim = parameter_role(name, plan.kind)
            if role == "replicated":
                trunk.pieces.append(_Piece(param))
            elif role == "branch":
                by_owners[plan.block_owners[block]].pieces.append(_Piece(param))
        if plan.kind == "neuron":
            # Per block, the worker's kept channels grouped by owner set; local positions follow the global
            # channel order, so every member packs the same channels in the same order.
            for k in range(plan.layout.num_blocks):
                kept = plan.kept_channels(worker, k)
                local: dict[frozenset[int], list[int]] = {}
                for position, channel in enumerate(kept):
                    local.setdefault(plan.channel_owners[k][channel], []).append(position)
                for owners, positions in local.items():
                    index = torch.tensor(positions, dtype=torch.long, device=next(iter(params.values())).device)
                    for name, param in params.items():
                        role, block, dim = parameter_role(name, plan.kind)
                        if role == "hidden" and block == k:
                            by_owners[owners].pieces.append(_Piece(param, dim, index))
        return [b for b in buckets if worker in b.owners and b.pieces]

    # -- collectives ------------------------------------------------------------------------------
    def _reduce(self, read: Callable[[_Piece], torch.Tensor], write: Callable[[_Piece, torch.Tensor], None],
                op: dist.ReduceOp = dist.ReduceOp.SUM, divide: bool = True, count: bool = True) -> None:
        for bucket in self.buckets:
            flat = torch.cat([read(piece).reshape(-1) for piece in bucket.pieces])
            if bucket.group is not None:
                dist.all_reduce(flat, op=op, group=bucket.group)
                if count:
                    payload = flat.numel() * flat.element_size()
                    self.stats["payload_bytes"] += payload
                    self.stats["wire_bytes"] += _ring_wire_bytes(payload, len(bucket.owners))
                    self.stats["collectives"] += 1
            if divide:
                flat.div_(bucket.divisor)
            offset = 0
            for piece in bucket.pieces:
                size = piece.numel()
                write(piece, flat[offset:offset + size])
                offset += size

    def average(self, engine: str | None = None) -> dict[str, int]:
        """Replace every .grad of the subnetwork by the masked average over its owners (in place);
        `engine` overrides the one chosen at construction (every rank must pass the same)."""
        engine = engine or self.engine
        if engine not in ENGINES:
            raise AveragingError(f"unknown averaging engine {engine!r}; known: {', '.join(ENGINES)}")
        self.stats = {"payload_bytes": 0, "wire_bytes": 0, "collectives": 0}
        for param in self.params.values():
            if param.grad is None:  # a parameter autograd did not reach still sends its zeros
                param.grad = torch.zeros_like(param)
        if engine == "dense":
            self._average_dense()
        else:
            self._reduce(lambda piece: piece.read(piece.param.grad), lambda piece, v: piece.write(piece.param.grad, v))
        return dict(self.stats)

    def _average_dense(self) -> None:
        subnet, plan = self.subnet, self.plan
        device = next(iter(self.params.values())).device
        for name, where in subnet.full_shapes.items():
            full = torch.zeros(where, device=device)
            if name in self.params:
                subnet.to_full(name, self.params[name].grad, out=full)
            dist.all_reduce(full)
            payload = full.numel() * full.element_size()
            self.stats["payload_bytes"] += payload
            self.stats["wire_bytes"] += _ring_wire_bytes(payload, self.world)
            self.stats["collectives"] += 1
            full.div_(plan.owner_count(name))
            if name in self.params:
                self.params[name].grad.copy_(subnet.from_full(name, full))

    @torch.no_grad()
    def owner_discrepancy(self) -> float:
        """Largest |difference| between this rank's copy of a shared parameter entry and any other owner's
        (0.0 when every shared entry is identical across its owners); collective, call on every rank."""
        worst = torch.zeros((), device=next(iter(self.params.values())).device)
        for bucket in self.buckets:
            local = torch.cat([piece.read(piece.param.detach()).reshape(-1) for piece in bucket.pieces])
            if bucket.group is None:
                continue
            high, low = local.clone(), local.clone()
            dist.all_reduce(high, op=dist.ReduceOp.MAX, group=bucket.group)
            dist.all_reduce(low, op=dist.ReduceOp.MIN, group=bucket.group)
            worst = torch.maximum(worst, (high - low).abs().max())
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        return float(worst)


@torch.no_grad()
def gather_full_state(subnet: Subnetwork) -> dict[str, torch.Tensor]:
    """The unified full model's parameters, on every rank (collective): each worker scatters its
    slices into full coordinates, the sums are all-reduced and divided by the owner counts (owners hold
    identical values, so this is their common value). Holds one full model: for evaluation at the end."""
    plan = subnet.plan
    params = dict(subnet.named_parameters())
    device = next(iter(params.values())).device
    state = {}
    for name, shape in subnet.full_shapes.items():
        full = torch.zeros(shape, device=device)
        if name in params:
            subnet.to_full(name, params[name].detach(), out=full)
        dist.all_reduce(full)
        state[name] = full.div_(plan.owner_count(name))
    return state
