"""What a torch Learner checkpoint holds besides the learner's own state, and putting it back: trainable
weights, buffers, optimizer state and the RNG (TorchEngine.checkpoint_tensors / apply_restore call these).
The Learner writes the counters, method state, schedule and data fingerprint beside them and keeps the
checks and the all-or-nothing rollback; the file handling (atomic, checksummed, rotating) is
edgetrain.training.checkpoint's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from edgetrain.training.checkpoint import flatten_optimizer_state

if TYPE_CHECKING:
    from edgetrain.training.learner import Learner

CHECKPOINT_FORMAT = "edgetrain-learner-1"


def state_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a checkpoint carries (running statistics, say): all but a packed base's codes and scales
    (edgetrain.models.quantized), which are frozen base weights and come from the base model as its dense
    frozen weights do -- a SmolLM2 GGUF's would add about 94 MiB to every checkpoint."""
    from edgetrain.models.quantized import PackedMatrix

    packed = {id(t) for module in model.modules() if isinstance(module, PackedMatrix)
              for t in module.buffers(recurse=False)}
    return {name: buffer for name, buffer in model.named_buffers() if id(buffer) not in packed}


def checkpoint_tensors(learner: Learner) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, extra state) of a checkpoint of `learner`; frozen base weights are not in it."""
    tensors = {f"param/{name}": p.detach() for name, p in learner.params.items()}
    for name, buffer in state_buffers(learner.model).items():
        tensors[f"buffer/{name}"] = buffer.detach()
    optimizer_tensors, optimizer_rest = flatten_optimizer_state(learner.optimizer.state_dict())
    tensors.update(optimizer_tensors)
    tensors["rng/torch"] = torch.get_rng_state()
    return tensors, {"optimizer": optimizer_rest}


def apply_restored(learner: Learner, tensors: dict[str, torch.Tensor], optimizer_state: dict) -> None:
    """Set `learner`'s tensors to a checkpoint already checked (Learner._restore undoes this if it fails)."""
    buffers = state_buffers(learner.model)
    with torch.no_grad():
        for name, param in learner.params.items():
            param.copy_(tensors[f"param/{name}"])
        for name, buffer in buffers.items():
            if f"buffer/{name}" in tensors:
                buffer.copy_(tensors[f"buffer/{name}"])
    learner.optimizer.load_state_dict(optimizer_state)
    torch.set_rng_state(tensors["rng/torch"])
