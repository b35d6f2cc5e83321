"""A worker's physically smaller subnetwork, and the masked forward of the full model it must agree with.

`materialise_subnetwork(config, plan, worker)` builds only what the worker owns: under neuron masking
each residual branch's conv1 has `len(kept)` output channels, norm1 that many affine pairs and conv2
that many input channels; under block masking a dropped block holds nothing but its projection
shortcut (if it has one) and computes relu(shortcut(h)). Parameters, gradients and optimizer state
are therefore the subnetwork's size; no full-size tensor is kept (initial values are drawn one full
parameter at a time, sliced, and dropped). Parameter names are those of the full model, and
`Subnetwork.slices` says where each one sits in full-model coordinates.

`masked_forward(model, plan, worker, x)` is the reference: the full-size model with m_i applied
(hidden channels multiplied by their 0/1 mask, norm1's statistics over active channels only, dropped
branches skipped). Its gradient is zero outside m_i and equals the subnetwork's gradient inside.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from edgetrain.methods.subnet_dp.plan import SubnetPlan
from edgetrain.models.resnet import BasicBlock, ClassifierHead, ResNet, Stem, make_norm
from edgetrain.models.resnet_subnet import SubnetResNetConfig, initial_parameter


class SubsetGroupNorm(nn.Module):
    """GroupNorm over the kept channels of a full GroupNorm: channels [sum(sizes[:g]), sum(sizes[:g+1]))
    form group g, whose mean and variance are taken over those channels only (groups may differ in
    size, and an empty group is skipped). Equals nn.GroupNorm when the sizes are equal."""

    def __init__(self, group_sizes: tuple[int, ...], eps: float = 1e-5) -> None:
        super().__init__()
        self.group_sizes = tuple(int(s) for s in group_sizes)
        self.eps = eps
        channels = sum(self.group_sizes)
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sizes = [s for s in self.group_sizes if s]
        if len(set(sizes)) == 1:
            return F.group_norm(x, len(sizes), self.weight, self.bias, self.eps)
        parts = [F.group_norm(part, 1, None, None, self.eps) for part in torch.split(x, sizes, dim=1)]
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return torch.cat(parts, dim=1) * self.weight.view(shape) + self.bias.view(shape)

    def extra_repr(self) -> str:
        return f"group_sizes={self.group_sizes}, eps={self.eps}"


class SlimBasicBlock(nn.Module):
    """A BasicBlock whose residual branch keeps `hidden` of its hidden channels (neuron masking)."""

    def __init__(self, in_channels: int, hidden: int, out_channels: int, stride: int, group_sizes: tuple[int, ...],
                 config: SubnetResNetConfig) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, hidden, 3, stride=stride, padding=1, bias=False)
        self.norm1 = SubsetGroupNorm(group_sizes)
        self.conv2 = nn.Conv2d(hidden, out_channels, 3, stride=1, padding=1, bias=False)
        self.norm2 = make_norm(config, out_channels)
        self.act = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                                          make_norm(config, out_channels))

    forward = BasicBlock.forward


class DroppedBlock(nn.Module):
    """Block masking's z = 0: relu(shortcut(h)) -- h itself for an identity shortcut (h >= 0 after a ReLU)."""

    def __init__(self, shortcut: nn.Module) -> None:
        super().__init__()
        self.shortcut = shortcut
        self.act = nn.ReLU()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.act(self.shortcut(h))


@dataclass(frozen=True)
class Slice:
    """Where a subnetwork parameter sits in the full one: the whole tensor (dim None) or `index` along `dim`."""
    full_shape: tuple[int, ...]
    dim: int | None = None
    index: torch.Tensor | None = None  # long, sorted


class Subnetwork(nn.Module):
    """Block view (embed, blocks, head) like the full ResNet; parameter names are the full model's."""
    task = "classify"

    def __init__(self, config: SubnetResNetConfig, plan: SubnetPlan, worker: int) -> None:
        super().__init__()
        self.config, self.plan, self.worker = config, plan, worker
        self.embed = Stem(config)
        blocks: list[nn.Module] = []
        in_channels = config.width
        k = 0
        for stage, (count, width) in enumerate(zip(config.blocks_per_stage, config.stage_widths)):
            for index in range(count):
                stride = 2 if stage > 0 and index == 0 else 1
                if plan.kind == "block" and not plan.holds_block(worker, k):
                    shortcut: nn.Module = nn.Identity()
                    if stride != 1 or in_channels != width:
                        shortcut = nn.Sequential(nn.Conv2d(in_channels, width, 1, stride=stride, bias=False),
                                                 make_norm(config, width))
                    blocks.append(DroppedBlock(shortcut))
                elif plan.kind == "block":
                    blocks.append(BasicBlock(in_channels, width, stride, config))
                else:
                    kept = len(plan.kept_channels(worker, k))
                    blocks.append(SlimBasicBlock(in_channels, kept, width, stride, plan.group_sizes(worker, k), config))
                in_channels = width
                k += 1
        self.blocks = nn.ModuleList(blocks)
        self.head = ClassifierHead(in_channels, config.num_classes)
        self.slices: dict[str, Slice] = {}
        self.full_shapes: dict[str, tuple[int, ...]] = {}  # every full-model parameter, dropped ones included

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    # -- full-model coordinates -----------------------------------------------------------------
    def to_full(self, name: str, value: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`value` (this subnetwork's `name`, or its gradient) scattered into a full-size tensor (zeros
        elsewhere, or the entries of `out`, which is written in place)."""
        where = self.slices[name]
        if out is None:
            out = value.new_zeros(where.full_shape)
        if where.dim is None:
            out.copy_(value)
        else:
            out.index_copy_(where.dim, where.index.to(value.device), value)
        return out

    def from_full(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This worker's slice of full-size tensor `full` for parameter `name`."""
        where = self.slices[name]
        if where.dim is None:
            return full
        return full.index_select(where.dim, where.index.to(full.device))

    def full_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.named_parameters():
            yield name, self.to_full(name, param.detach())


def _full_shapes(config: SubnetResNetConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        full = ResNet(config)
    return {name: tuple(p.shape) for name, p in full.named_parameters()}


def materialise_subnetwork(config: SubnetResNetConfig, plan: SubnetPlan, worker: int, *,
                           device: str | torch.device = "cpu",
                           source: nn.Module | Mapping[str, torch.Tensor] | None = None) -> Subnetwork:
    """Worker `worker`'s subnetwork, its values sliced from `source` (a full model or state dict) or, by
    default, from the per-name initial values of `config` (edgetrain.models.resnet_subnet)."""
    if not 0 <= worker < plan.num_workers:
        raise ValueError(f"worker {worker} outside 0..{plan.num_workers - 1}")
    shapes = _full_shapes(config)
    with torch.device("meta"):
        subnet = Subnetwork(config, plan, worker)
    subnet = subnet.to_empty(device=device)
    subnet.full_shapes = shapes
    if isinstance(source, nn.Module):
        source = dict(source.named_parameters())
    with torch.no_grad():
        for name, param in subnet.named_parameters():
            if name not in shapes:
                raise KeyError(f"subnetwork parameter {name} has no counterpart in the full model")
            how, dim, indices = plan.slice_of(name, worker)
            if how == "none":
                raise AssertionError(f"{name} is dropped for worker {worker} but was materialised")
            index = None if how == "all" else torch.tensor(indices, dtype=torch.long)
            subnet.slices[name] = Slice(shapes[name], None if how == "all" else dim, index)
            full = (source[name].detach().to("cpu", torch.float32) if source is not None
                    else initial_parameter(config, name, shapes[name]))
            if tuple(full.shape) != shapes[name]:
                raise ValueError(f"source {name} has shape {tuple(full.shape)}, expected {shapes[name]}")
            param.copy_(subnet.from_full(name, full))
            del full
    for name, param in subnet.named_parameters():
        if tuple(param.shape) != _sliced_shape(subnet.slices[name]):
            raise AssertionError(f"{name}: built {tuple(param.shape)}, plan says {_sliced_shape(subnet.slices[name])}")
    return subnet


def _sliced_shape(where: Slice) -> tuple[int, ...]:
    if where.dim is None:
        return where.full_shape
    shape = list(where.full_shape)
    shape[where.dim] = len(where.index)
    return tuple(shape)


# -- the reference: the full model with the mask applied ------------------------------------------

def masked_group_norm(x: torch.Tensor, norm: nn.GroupNorm, keep: torch.Tensor) -> torch.Tensor:
    """GroupNorm of `x` whose statistics in each group use only the channels where `keep` is True;
    dropped channels come out as 0 (and their affine parameters get no gradient)."""
    batch, channels = x.shape[:2]
    groups = norm.num_groups
    m = keep.to(x.dtype).view(1, groups, channels // groups, *([1] * (x.dim() - 2)))
    xs = x.view(batch, groups, channels // groups, *x.shape[2:])
    dims = tuple(range(2, xs.dim()))
    count = (m.expand_as(xs).sum(dim=dims, keepdim=True)).clamp_min(1.0)
    mean = (xs * m).sum(dim=dims, keepdim=True) / count
    var = (((xs - mean) * m) ** 2).sum(dim=dims, keepdim=True) / count
    y = ((xs - mean) / torch.sqrt(var + norm.eps)).view_as(x)
    shape = (1, channels) + (1,) * (x.dim() - 2)
    keep = keep.to(x.dtype)
    return y * (norm.weight * keep).view(shape) + (norm.bias * keep).view(shape)


def masked_block(block: nn.Module, h: torch.Tensor, keep: torch.Tensor | None,
                 branch_scale: float = 1.0) -> torch.Tensor:
    """One BasicBlock of the full model with hidden-channel mask `keep` (None: every channel); the
    branch's output is multiplied by `branch_scale` (stochastic depth's test-time rule)."""
    out = block.conv1(h)
    if keep is None:
        out = block.act(block.norm1(out))
    else:
        mask = keep.to(out.dtype).view(1, -1, 1, 1)
        out = block.act(masked_group_norm(out * mask, block.norm1, keep))
    out = block.norm2(block.conv2(out))
    if branch_scale != 1.0:
        out = out * branch_scale
    return block.act(out + block.shortcut(h))


def dropped_block(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return block.act(block.shortcut(h))


def masked_forward(model: nn.Module, plan: SubnetPlan, worker: int, x: torch.Tensor) -> torch.Tensor:
    """The full model with worker `worker`'s mask m_i applied (the forward of theta_i = m_i * theta)."""
    h = model.embed(x)
    for k, block in enumerate(model.blocks):
        if plan.kind == "block":
            h = masked_block(block, h, None) if plan.holds_block(worker, k) else dropped_block(block, h)
        else:
            h = masked_block(block, h, plan.channel_mask(worker, k).to(h.device))
    return model.head(h)


def full_model_from_subnetworks(config: SubnetResNetConfig, subnets: list[Subnetwork]) -> ResNet:
    """The unified full model from the subnetworks of all workers (single process; each parameter entry
    is read from its first owner). The distributed version is averaging.gather_full_state."""
    from edgetrain.models.resnet_subnet import build_subnet_resnet

    model = build_subnet_resnet(config)
    filled = {name: torch.zeros(p.shape, dtype=torch.bool) for name, p in model.named_parameters()}
    with torch.no_grad():
        for subnet in subnets:
            for name, param in subnet.named_parameters():
                full = subnet.to_full(name, param.detach())
                mask = subnet.to_full(name, torch.ones_like(param, dtype=torch.bool))
                take = mask & ~filled[name]
                dict(model.named_parameters())[name][take] = full[take]
                filled[name] |= mask
    missing = [n for n, f in filled.items() if not bool(f.all())]
    if missing:
        raise ValueError(f"no subnetwork holds all of {missing[:3]}")
    return model


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state tensors held for `module`."""
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in module.parameters() if p.grad is not None)
    opt = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            opt += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    return {"parameters": params, "gradients": grads, "optimizer": opt}
