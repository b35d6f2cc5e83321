"""What each stage of a staged schedule trains and freezes: the body segment, its bridge (segprop's
adapter, lw's auxiliary classifier), the global head, the committed prefix, and the path that runs with
autograd (`ActivePath`).

SegProp's global head (the last `head_blocks` units and the task head) trains in every stage and is
always on the loss path; a segment reaches it through its stage's adapter. lw has no persistent head:
each stage ends in its own auxiliary classifier, and a last stage trains the task head alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from edgetrain.methods.segprop.adapters import AuxiliaryClassifier, make_adapter, model_norm_groups
from edgetrain.methods.segprop.eval_pins import StageAdapters
from edgetrain.methods.segprop.plan import Stage, StagePlan
from edgetrain.methods.segprop.views import Spec, UnitView


class ActivePath(nn.Module):
    """What runs with autograd in one stage: [embed] -> active units -> bridge -> head units -> head.
    Its own module so that a distributed wrapper (DistributedDataParallel) can take exactly it."""

    def __init__(self, embed: nn.Module | None, units: Sequence[nn.Module], bridge: nn.Module | None,
                 tail: Sequence[nn.Module], head: nn.Module | None, checkpointed: bool) -> None:
        super().__init__()
        self.embed = embed
        self.units = nn.ModuleList(units)
        self.bridge = bridge
        self.tail = nn.ModuleList(tail)
        self.head = head
        self.checkpointed = checkpointed
        # Set by the trainer when it splits the backward at the global head (head_grads_last): the
        # forward then keeps the state entering the head units, for take_head_input().
        self.keep_head_input = False
        self._head_input: Any = None

    def _unit(self, unit: nn.Module, h: Any) -> Any:
        if self.checkpointed:
            # Non-reentrant: also right when the unit's input needs no grad (a detached frozen prefix).
            return activation_checkpoint(unit, h, use_reentrant=False)
        return unit(h)

    def forward(self, h: Any) -> Any:
        if self.embed is not None:
            h = self.embed(h)
        for unit in self.units:
            h = self._unit(unit, h)
        if self.bridge is not None:
            h = self.bridge(h)
        if self.keep_head_input:
            self._head_input = h
        for unit in self.tail:
            h = self._unit(unit, h)
        return self.head(h) if self.head is not None else h

    def take_head_input(self) -> list[torch.Tensor]:
        """The tensors of the last forward that enter the head units (the ones autograd tracks), handed
        over once: the path keeps no reference, so they are freed with the graph."""
        state, self._head_input = self._head_input, None
        leaves = [state] if isinstance(state, torch.Tensor) else list(state or ())
        return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def module_params(modules: Iterable[nn.Module | None]) -> list[nn.Parameter]:
    """The parameters of `modules`, each once (shared modules and tied weights included)."""
    seen: dict[int, nn.Parameter] = {}
    for module in modules:
        if module is not None:
            for param in module.parameters():
                seen.setdefault(id(param), param)
    return list(seen.values())


def unique(params: list[nn.Parameter]) -> list[nn.Parameter]:
    return list({id(p): p for p in params}.values())


def build_bridges(name: str, plan: StagePlan, view: UnitView, specs: list[Spec], num_outputs: int,
                  model: nn.Module, kind: str, given: dict[int, nn.Module], device: torch.device,
                  dtype: torch.dtype, aux_head: str) -> StageAdapters:
    """Each bridging stage's adapter (segprop) or auxiliary classifier (lw), keyed by str(stage index);
    `given` overrides the built ones."""
    adapters = StageAdapters()
    head_input = specs[plan.head_start] if name == "segprop" else specs[-1]
    for stage in plan.stages:
        if not stage.bridge:
            continue
        key = int(stage.index)
        if key in given or str(key) in given:
            module = given.get(key, given.get(str(key)))
        else:
            module = make_adapter(specs[stage.end], head_input, kind, model_norm_groups(model))
        if name == "lw":
            module = AuxiliaryClassifier(module, view.head, head_input, num_outputs, aux_head)
        if module is not None:
            adapters[str(key)] = module.to(device=device, dtype=dtype)
    return adapters


@dataclass
class StageParts:
    """The modules of a plan's stages over one view, and the adapters that bridge them."""
    view: UnitView
    adapters: StageAdapters
    checkpointed: bool = False

    def bridge(self, stage: Stage) -> nn.Module | None:
        return self.adapters[str(stage.index)] if str(stage.index) in self.adapters else None

    def body(self, stage: Stage) -> list[nn.Module]:
        """Modules trained on the segment's own schedule: [embed], units, bridge."""
        modules: list[nn.Module] = [self.view.embed] if stage.trains_embed else []
        modules += self.view.units[stage.start:stage.end]
        bridge = self.bridge(stage)
        return modules + ([bridge] if bridge is not None else [])

    def head(self, stage: Stage) -> list[nn.Module]:
        """Modules trained on the global head's schedule: head units and the task head."""
        modules = list(self.view.units[stage.tail_start:])
        return modules + ([self.view.head] if stage.trains_head else [])

    def committed(self, stage: Stage) -> list[nn.Module]:
        if stage.frozen_depth is None:
            return []
        return [self.view.embed, *self.view.units[:stage.frozen_depth]]

    def path(self, stage: Stage) -> ActivePath:
        return ActivePath(self.view.embed if stage.trains_embed else None, self.view.units[stage.start:stage.end],
                          self.bridge(stage), self.view.units[stage.tail_start:],
                          self.view.head if stage.trains_head else None, self.checkpointed)

    def all_modules(self) -> list[nn.Module]:
        return [self.view.embed, *self.view.units, self.view.head, *self.adapters.values()]

    def prefix_shared_with_head(self, plan: StagePlan, trainable: set[int]) -> list[nn.Parameter]:
        """Trainable parameters of the prefix that the global head holds too (tied embeddings)."""
        head_params = {id(p) for p in module_params([*self.view.units[plan.head_start:], self.view.head])}
        body = module_params([self.view.embed, *self.view.units[:plan.head_start]])
        return [p for p in body if id(p) in head_params and id(p) in trainable]
