"""What ownership masks of subnetwork data parallelism (Singh et al. 2025, §3.1-3.2) need to know about a
residual network, and which role each of its parameters plays.

Maskable units: under neuron masking, hidden channel c of a residual branch -- output channel c of
`blocks.k.conv1` (Eq. 1: its weight row and, through norm1, its affine pair) with input channel c of
`blocks.k.conv2` (Eq. 2: its weight column); under block masking, a whole branch
`blocks.k.{conv1, norm1, conv2, norm2}`.

The replicated trunk: a worker's subnetwork needs a path from input to loss, so the stem (`embed.*`),
the classifier (`head.*`), the projection shortcuts (`blocks.k.shortcut.*`) and, under neuron masking,
the residual stream's norms (`blocks.k.norm2.*`) are held by all N workers and averaged over N. With
P < N no assignment could give them P owners: a parameter W[r, c] of a dense layer is held by the
workers owning both row r and column c, and "exactly P for every (r, c)" forces one owner set for every
unit of the chain. How large the trunk is: docs/methods/subnet-dp.md.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

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

