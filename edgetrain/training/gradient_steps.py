"""Gradient accumulation and clipping for the Learner: a step's batch cut into micro-batches whose
gradients are summed, each weighted by its share of the loss's denominator (the batch's valid targets),
so the sum is the whole batch's gradient while only one micro-batch's activations are held; then one
optimizer update, clipped to a global L2 norm when asked."""
from __future__ import annotations

import math
from typing import Any

from edgetrain.data.batch import Batch
from edgetrain.registry import EdgetrainError
from edgetrain.training.losses import IGNORE_INDEX


def check_accumulation(accumulate: Any, max_grad_norm: Any) -> tuple[int, float | None]:
    """(accumulate, max_grad_norm) validated: a whole number >= 1, and None or a finite number > 0."""
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise EdgetrainError(f"accumulate must be a whole number of micro-batches >= 1, got {accumulate!r}")
    if max_grad_norm is not None:
        if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) \
                or not math.isfinite(max_grad_norm) or max_grad_norm <= 0:
            raise EdgetrainError(f"max_grad_norm must be a finite number > 0 (or None), got {max_grad_norm!r}")
        max_grad_norm = float(max_grad_norm)
    return accumulate, max_grad_norm


def check_gradient_step_method(method: Any, name: str) -> None:
    """Accumulation and clipping replace a method's step by its gradients and one optimizer update: only
    methods whose step is exactly that (`gradient_step = True`) may be driven so."""
    if not getattr(method, "gradient_step", False):
        raise EdgetrainError(f"accumulate and max_grad_norm drive a method by its gradients and one optimizer "
                             f"update; method {name!r} steps in its own way (stages, stale modules, workers "
                             "or perturbations), so it takes neither")


def micro_batches(batch: Batch, count: int) -> list[tuple[Batch, float]]:
    """`batch` cut into `count` slices of samples (the first `len % count` one larger), each with its
    share of the batch's valid targets; slices with none are left out (they add nothing to the loss)."""
    samples = batch.inputs.shape[0]
    if count > samples:
        raise EdgetrainError(f"accumulate={count} cuts each batch into {count} micro-batches of samples, "
                             f"but batch {batch.index} has {samples}")
    valid = (batch.targets != IGNORE_INDEX)
    total = int(valid.sum())
    if total == 0:
        raise EdgetrainError(f"batch {batch.index} has no target to learn from (all are {IGNORE_INDEX})")
    sizes = [samples // count + (1 if i < samples % count else 0) for i in range(count)]
    slices, start = [], 0
    for size in sizes:
        stop = start + size
        share = int(valid[start:stop].sum()) / total
        if share > 0:
            slices.append((Batch(batch.inputs[start:stop], batch.targets[start:stop], index=batch.index), share))
        start = stop
    return slices
