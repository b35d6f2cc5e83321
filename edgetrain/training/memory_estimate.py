"""Refuse a first step that cannot fit the memory budget before allocating it.

The budget guard measures the first step, so a step far over the budget would allocate its whole peak
(13x the budget in the case that made us write this) before it is refused. Instead, the learner first
runs the step on slices of the batch holding 1/8, 1/4 and 1/2 of its tokens, each undone afterwards. A
step's memory grows with the tokens it holds, so a slice that is already over the budget proves the
whole batch is too: it is refused having allocated at most the slice's peak, about twice the budget
when memory grows linearly. Only measured values decide (no extrapolation), so a step that fits is never
refused by the estimate; when every slice fits, the full step is measured exactly as before.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from edgetrain.data.batch import Batch

# Slices of the batch tried in turn, as fractions of its tokens; each at most doubles the previous one,
# which is what bounds the memory allocated before a refusal.
SLICE_FRACTIONS = (1 / 8, 1 / 4, 1 / 2)


@dataclass(frozen=True)
class SliceOverBudget:
    """A slice of the first batch whose own step does not fit: the whole batch cannot either."""

    needed_bytes: int
    slice_tokens: int
    batch_tokens: int

    def describe(self, method: str) -> str:
        """One entry of the budget error's list of what was tried."""
        return (f"{method}: over {self.needed_bytes / 2**20:,.1f} MiB (measured on {self.slice_tokens} of the "
                f"batch's {self.batch_tokens} tokens)")


def _slice(batch: Batch, rows: int, columns: int | None) -> Batch:
    inputs, targets = batch.inputs[:rows], batch.targets[:rows]
    if columns is not None:
        inputs, targets = inputs[:, :columns], targets[:, :columns]
    return Batch(inputs, targets, batch.index)


def batch_slices(batch: Batch, fractions: tuple[float, ...] = SLICE_FRACTIONS) -> list[Batch]:
    """Prefixes of the batch holding about each fraction of its positions, smallest first, each strictly
    smaller than the one after it and than the batch. Rows go first; a language-model batch of fewer
    rows than the fraction asks for is cut along the sequence too (one row, a prefix of its positions)."""
    rows = batch.inputs.shape[0]
    sequence = batch.inputs.dim() >= 2 and batch.targets.dim() >= 2
    columns = batch.inputs.shape[1] if sequence else 1
    slices, sizes = [], []
    for fraction in fractions:
        positions = int(rows * columns * fraction)
        if positions < 1:
            continue
        if positions >= columns or not sequence:
            kept_rows = max(1, positions // columns) if sequence else positions
            size, piece = kept_rows * columns, _slice(batch, kept_rows, None)
        else:
            size, piece = positions, _slice(batch, 1, positions)
        if size >= rows * columns or (sizes and size <= sizes[-1]):
            continue
        sizes.append(size)
        slices.append(piece)
    return slices


def first_slice_over_budget(measure_step: Callable[[Batch], int | None], batch: Batch, weights_bytes: int,
                            budget_bytes: int) -> SliceOverBudget | None:
    """Run `measure_step` (a step that is undone afterwards; returns the memory it adds in bytes, as
    StepStats.peak_bytes, or None when the slice cannot be measured) on growing slices of `batch`; the
    first slice whose weights + added memory exceed the budget, or None when every slice fits (then
    measure the full step). `weights_bytes` is what the budget charges before the step: the weights,
    once (see Learner._first_step_within_budget)."""
    for piece in batch_slices(batch):
        peak = measure_step(piece)
        if peak is None:
            return None
        needed = weights_bytes + peak
        if needed > budget_bytes:
            return SliceOverBudget(needed, piece.num_tokens, batch.num_tokens)
    return None
