"""Head gradients last (segprop's `head_grads_last` option): a step's backward split at the global head.

In one backward the global head's parameter gradients are made first (the head is last in the forward)
and live through the segment's whole backward. Split in three parts, they are made after it instead:
the same weight gradients, computed once each; the head's saved activations live longer instead. Which
stages it applies to, and the backward itself, are here; the trainer's step calls `backward`, and its
active path (stage_parts.ActivePath) keeps the state entering the head units for it.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from edgetrain.registry import EdgetrainError


def check_option(name: str, value: Any) -> bool:
    """The option's value, which must be a plain bool (JSON true/false)."""
    if not isinstance(value, bool):
        raise EdgetrainError(f"{name}: head_grads_last must be true or false, got {value!r}")
    return value


def applies(enabled: bool, name: str, checkpointed: bool, wrapped: bool,
            body_params: list[nn.Parameter], head_grad_params: list[nn.Parameter]) -> bool:
    """Whether a stage's steps split the backward. Not for lw (no persistent head), nor with
    checkpointing (the head units would be recomputed, and their BatchNorm statistics updated, once
    more), nor under a distributed wrapper (its gradient reduction expects one backward per step)."""
    return (enabled and name == "segprop" and not checkpointed and not wrapped
            and bool(body_params) and bool(head_grad_params))


def backward(loss: torch.Tensor, head_input: list[torch.Tensor], head_params: list[nn.Parameter]) -> None:
    """loss.backward() in three parts, so that the head's parameter gradients do not exist while the
    segment's activations do: (1) the gradient of the state entering the head units, keeping the
    head's graph; (2) the segment's backward from there, which frees the segment's activations;
    (3) the gradients of `head_params` (every trainable parameter the head modules use). Autograd
    computes in each part only what that part needs, so the weight gradients are computed once and
    equal those of one backward (a tied parameter gets its two shares in two accumulations: equal up
    to the order of one addition); the activation-gradient ops of the head run twice. The head's saved
    activations live until (3). With no `head_input` reached by the loss, one ordinary backward.
    `head_input` is emptied: the caller keeps no reference through the segment's backward."""
    tensors = list(head_input)
    head_input.clear()
    grads = torch.autograd.grad(loss, tensors, retain_graph=True, allow_unused=True) if tensors else ()
    reached = [(t, g) for t, g in zip(tensors, grads) if g is not None]
    del tensors, grads
    if not reached:  # nothing trainable before the head: one ordinary backward
        loss.backward()
        return
    torch.autograd.backward([t for t, _ in reached], [g for _, g in reached])
    del reached
    loss.backward(inputs=head_params)
