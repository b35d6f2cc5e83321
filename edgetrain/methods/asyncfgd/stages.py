"""Cutting a model's block view into the K modules of an AsyncFGD pipeline.

The units are embed, blocks.0 .. blocks.N-1, head. Module 0 gets embed and the first blocks, module
K-1 the last blocks and the head; blocks are spread as evenly as their count allows, earlier modules
taking the extra ones (ResNet-18's 8 blocks in K=4 give the paper's one residual stage per worker,
FCS's 3 hidden layers in K=3 give Table 5's split). When K exceeds the number of blocks the head,
then the embed, become modules of their own (a 64-32-10 MLP in K=2 runs [embed + hidden] | [head]).
"""
from __future__ import annotations

from typing import Sequence

from torch import nn

from edgetrain.methods.fgd import ForwardStage, Unit, block_units
from edgetrain.methods.tangents import TangentBank
from edgetrain.registry import EdgetrainError


def split_units(units: Sequence[Unit], num_modules: int, split: Sequence[int] | None = None) -> list[list[Unit]]:
    """Group [embed, blocks..., head] into `num_modules` contiguous modules.

    split: blocks per module (K numbers summing to the block count; embed joins the first module,
    the head the last); None spreads them evenly."""
    if not isinstance(num_modules, int) or isinstance(num_modules, bool) or num_modules < 1:
        raise EdgetrainError(f"asyncfgd: num_modules must be a positive integer, got {num_modules!r}")
    if len(units) == 1:  # a model without a block view is one unit: it cannot be cut
        if num_modules != 1 or split is not None:
            raise EdgetrainError("asyncfgd: the model has no block view (embed/blocks/head), so it cannot be "
                                 "split into modules; use num_modules=1 or a model from the zoo")
        return [list(units)]
    embed, blocks, head = units[0], list(units[1:-1]), units[-1]
    if split is not None:
        split = [int(n) for n in split]
        if len(split) != num_modules or sum(split) != len(blocks) or min(split) < 0:
            raise EdgetrainError(f"asyncfgd: split {split} must give {num_modules} block counts summing to "
                                 f"{len(blocks)}")
        counts = split
    elif num_modules == 1:
        return [list(units)]
    elif num_modules <= len(blocks):
        base, extra = divmod(len(blocks), num_modules)
        counts = [base + (1 if k < extra else 0) for k in range(num_modules)]
    elif num_modules == len(blocks) + 1:
        return [[embed, blocks[0]], *[[b] for b in blocks[1:]], [head]]
    elif num_modules == len(blocks) + 2:
        return [[embed], *[[b] for b in blocks], [head]]
    else:
        raise EdgetrainError(f"asyncfgd: {num_modules} modules need at least {num_modules - 2} blocks; "
                             f"the model has {len(blocks)}")
    modules, start = [], 0
    for count in counts:
        modules.append(blocks[start:start + count])
        start += count
    modules[0].insert(0, embed)
    modules[-1].append(head)
    return modules


def build_stages(model: nn.Module, params: dict[str, nn.Parameter], bank: TangentBank, seed: int,
                 num_tangents: int, num_modules: int, split: Sequence[int] | None = None) -> list[ForwardStage]:
    groups = split_units(block_units(model), num_modules, split)
    stages = [ForwardStage(k, group, params, bank, seed, num_tangents, model, is_last=k == len(groups) - 1,
                           method="asyncfgd")
              for k, group in enumerate(groups)]
    owner: dict[str, int] = {}
    for stage in stages:
        for name in stage.params:
            if owner.setdefault(name, stage.index) != stage.index:
                raise EdgetrainError(f"asyncfgd: parameter {name} is used by modules {owner[name]} and "
                                     f"{stage.index} (tied weights); each module must own its parameters")
    return stages


def describe_split(stages: Sequence[ForwardStage]) -> str:
    """'embed+blocks.0 | head' -- for logs and benchmark tables."""
    return " | ".join("+".join(unit.name for unit in stage.units) for stage in stages)
