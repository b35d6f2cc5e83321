"""A `SubnetPlan` from explicit full-coordinate parameter masks m_i, checked against the structure
neuron or block masking requires."""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn

from edgetrain.methods.subnet_dp.layout import MaskError, ResNetLayout, parameter_role
from edgetrain.methods.subnet_dp.plan import SubnetPlan

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

