"""FLOPs per training sample, end-to-end vs each stage of a staged schedule (SegProp §4.6, Table 5).

The paper's accounting: a layer that trains costs its forward once plus twice for the backward (3x
forward), and once more with activation checkpointing (4x: forward, recompute, backward); a frozen
layer costs one forward; with SnapCheck a frozen prefix that is cached costs nothing. Forward FLOPs
of every part (embedding, each unit, each adapter, the head) are counted by torch's FlopCounterMode
on a real forward (matrix multiplies and convolutions, multiply-add = 2 FLOPs), divided by the batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from edgetrain.methods.segprop.evaluation import all_in_eval
from edgetrain.methods.segprop.trainer import StagedTrainer


@dataclass
class StageFlops:
    name: str
    active_forward: float   # forward FLOPs per sample of what trains (units, adapter, head units, head)
    frozen_forward: float   # forward FLOPs per sample of the committed prefix
    total: float            # per training sample, by the paper's multipliers
    total_snapcheck: float  # the same with the frozen prefix served from SnapCheck


def _flops(fn: Any, *args: Any) -> tuple[float, Any]:
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        out = fn(*args)
    return float(counter.get_total_flops()), out


def part_flops(trainer: StagedTrainer, inputs: torch.Tensor) -> dict[str, Any]:
    """Forward FLOPs per sample of the embedding, each unit, each stage's bridge and the head."""
    view = trainer.view
    batch = inputs.shape[0]
    with all_in_eval([view.embed, *view.units, view.head, *trainer.adapters.values()]):
        embed, state = _flops(view.embed, inputs)
        states, units = [state], []
        for unit in view.units:
            count, state = _flops(unit, state)
            units.append(count / batch)
            states.append(state)
        head, _ = _flops(view.head, state)
        bridges = {}
        for stage in trainer.stages:
            bridge = trainer.bridge(stage)
            if bridge is not None:
                bridges[stage.index] = _flops(bridge, states[stage.end])[0] / batch
    return {"embed": embed / batch, "units": units, "head": head / batch, "bridges": bridges}


def schedule_flops(trainer: StagedTrainer, inputs: torch.Tensor, *, checkpointing: bool = False
                   ) -> tuple[float, list[StageFlops]]:
    """(e2e FLOPs per sample, per-stage FLOPs per sample) for `trainer`'s plan."""
    parts = part_flops(trainer, inputs)
    train = 4.0 if checkpointing else 3.0
    units = parts["units"]
    e2e = train * (parts["embed"] + sum(units) + parts["head"])
    stages = []
    for stage in trainer.stages:
        active = sum(units[stage.start:stage.end]) + sum(units[stage.tail_start:])
        active += parts["embed"] if stage.trains_embed else 0.0
        active += parts["bridges"].get(stage.index, 0.0)
        active += parts["head"] if stage.trains_head else 0.0
        frozen = 0.0 if stage.frozen_depth is None else parts["embed"] + sum(units[:stage.frozen_depth])
        stages.append(StageFlops(stage.name, active, frozen, train * active + frozen, train * active))
    return e2e, stages
