"""What a torch Learner checkpoint holds, and putting it back: the tensors and metadata `save` writes
(trainable weights, buffers, optimizer state, RNG, method state, counters, schedule, data fingerprint), and
applying a checked checkpoint to the learner. Learner._restore keeps the checks and the all-or-nothing
rollback around `apply_restored`; the file handling (atomic, checksummed, rotating) is edgetrain.checkpoint's.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch

from edgetrain.checkpoint import flatten_optimizer_state

if TYPE_CHECKING:
    from edgetrain.learner import Learner

CHECKPOINT_FORMAT = "edgetrain-learner-1"


def checkpoint_payload(learner: Learner) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a checkpoint of `learner`; frozen base weights are not in it."""
    tensors = {f"param/{name}": p.detach() for name, p in learner.params.items()}
    for name, buffer in learner.model.named_buffers():
        tensors[f"buffer/{name}"] = buffer.detach()
    optimizer_tensors, optimizer_rest = flatten_optimizer_state(learner.optimizer.state_dict())
    tensors.update(optimizer_tensors)
    tensors["rng/torch"] = torch.get_rng_state()
    metadata = {"format": CHECKPOINT_FORMAT, "method": learner.method_name,
                "state": json.dumps({"steps_done": learner.steps_done,
                                     "stream_position": learner.stream_position,
                                     "method": learner.method.state_dict(),
                                     "optimizer": optimizer_rest,
                                     "lr_schedule": learner.lr_schedule.to_dict(),
                                     "base_lrs": learner.base_lrs,
                                     "data": learner.data_fingerprint})}
    return tensors, metadata


def apply_restored(learner: Learner, tensors: dict[str, torch.Tensor], state: dict, optimizer_state: dict,
                   source: str) -> None:
    """Set `learner` to a checkpoint already checked by Learner._restore (which undoes this if it fails)."""
    buffers = dict(learner.model.named_buffers())
    with torch.no_grad():
        for name, param in learner.params.items():
            param.copy_(tensors[f"param/{name}"])
        for name, buffer in buffers.items():
            if f"buffer/{name}" in tensors:
                buffer.copy_(tensors[f"buffer/{name}"])
    learner.optimizer.load_state_dict(optimizer_state)
    torch.set_rng_state(tensors["rng/torch"])
    learner.method.load_state_dict(state["method"])
    learner.steps_done, learner.stream_position = state["steps_done"], state["stream_position"]
    data = state.get("data")
    learner.data_fingerprint = data if isinstance(data, dict) else None
    learner._resumed_data = (learner.data_fingerprint, source) if learner.data_fingerprint is not None else None
