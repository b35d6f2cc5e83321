"""`bp` (plain autograd backprop) and `mebp` (per-block activation checkpointing + autograd).

Both give exact gradients; they differ only in how the forward is run. `mebp` keeps just each block's
input during the forward and re-runs one block at a time under autograd in backward -- the MeBP baseline
of the MeSP paper, where autograd still decides what a recomputed block keeps.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from edgetrain.data.batch import Batch
from edgetrain.methods.base import METHODS, no_options, require_finite, take_gradients, trainable_parameters
from edgetrain.training.losses import task_loss


def full_forward(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    return model(inputs)


def checkpointed_forward(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    h = model.embed(inputs)
    for block in model.blocks:
        # Non-reentrant checkpointing also works when the block input needs no grad (frozen embed + LoRA).
        h = checkpoint(block, h, use_reentrant=False)
    return model.head(h)


class Autograd:
    # Its step is its gradients and one optimizer update: the learner may accumulate and clip them.
    gradient_step = True

    def __init__(self, name: str, model: nn.Module,
                 forward: Callable[[nn.Module, torch.Tensor], torch.Tensor], **options: Any) -> None:
        no_options(name, options)
        self.name = name
        self.model = model
        self.forward = forward
        self.params = trainable_parameters(model)

    def forward_loss(self, batch: Batch) -> torch.Tensor:
        return task_loss(self.model, self.forward(self.model, batch.inputs), batch.targets)

    def gradients(self, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        for param in self.params.values():
            param.grad = None
        loss = self.forward_loss(batch)
        loss.backward()
        return loss.detach(), take_gradients(self.params)

    def step(self, batch: Batch, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = self.forward_loss(batch)
        # An inf loss can have finite gradients (or none reaching a parameter): refuse it before the update.
        require_finite(float(loss.detach()), "loss")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


METHODS.add("bp", lambda model, **options: Autograd("bp", model, full_forward, **options))
METHODS.add("mebp", lambda model, **options: Autograd("mebp", model, checkpointed_forward, **options))
