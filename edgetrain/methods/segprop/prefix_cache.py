"""The committed prefix's output for a batch, computed or served from SnapCheck (snapcheck.py).

A cached state is valid while the prefix is unchanged: its stamp, the sum of the version counters of the
prefix's parameters and buffers, moves with any in-place write (an optimizer step, a checkpoint load).
When a stage commits one more segment, the new depth is built from the previous depth's cached state, so
only the newly committed units run.
"""
from __future__ import annotations

from typing import Any, Hashable

import torch

from edgetrain.data.batch import Batch
from edgetrain.methods.segprop.snapcheck import SnapCheck, input_fingerprint
from edgetrain.methods.segprop.views import UnitView


def parse_optional_bytes(value: Any) -> int | None:
    """None (no limit), 0, or a byte count ("256MiB", 2**20, ...)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        return 0
    from edgetrain.utils.memory_sizes import parse_bytes

    return parse_bytes(value)


def make_snapcheck(budget: Any, spill: str | None, disk_budget: Any) -> SnapCheck:
    memory = parse_optional_bytes(budget)
    return SnapCheck(2**62 if memory is None else memory, spill_dir=spill,
                     disk_budget_bytes=parse_optional_bytes(disk_budget))


class FrozenPrefix:
    """Runs [embed, units[:depth]] without autograd, through `snapcheck` when there is one. A batch's
    id is batch.index, or batch.index % period for a stream whose order repeats every `period` batches."""

    def __init__(self, view: UnitView, snapcheck: SnapCheck | None, period: int | None) -> None:
        self.view = view
        self.snapcheck = snapcheck
        self.period = period

    def stamp(self, depth: int) -> int:
        """Sum of the version counters of the prefix [embed, units[:depth]]: changes with any in-place
        write to its parameters or buffers (an optimizer step, a checkpoint load)."""
        modules = [self.view.embed, *self.view.units[:depth]]
        return sum(t._version for m in modules for t in (*m.parameters(), *m.buffers()))

    def batch_id(self, batch: Batch) -> Hashable:
        return batch.index % self.period if self.period else batch.index

    @torch.no_grad()
    def state(self, batch: Batch, depth: int) -> Any:
        """The prefix's output for `batch` (detached), from SnapCheck when it holds it."""
        if self.snapcheck is None:
            return self.view.run(self.view.embed(batch.inputs), 0, depth)
        batch_id, fingerprint = self.batch_id(batch), input_fingerprint(batch.inputs)
        state = self.snapcheck.get(depth, batch_id, fingerprint, self.stamp(depth))
        if state is not None:
            return state
        nearest = self.snapcheck.nearest(depth, batch_id, fingerprint, self.stamp)
        if nearest is not None:
            # Build the new depth from the previous one: only the newly committed units run.
            shallower, state = nearest
            state = self.view.run(state, shallower, depth)
            self.snapcheck.drop(shallower, batch_id)
        else:
            state = self.view.run(self.view.embed(batch.inputs), 0, depth)
        self.snapcheck.put(depth, batch_id, state, fingerprint, self.stamp(depth))
        return state

    def retain(self, depths: set[int]) -> None:
        """Keep only these depths' entries (the current stage's and the previous one's, to build from)."""
        if self.snapcheck is not None:
            self.snapcheck.retain(depths)

    def drop(self) -> None:
        if self.snapcheck is not None:
            self.snapcheck.drop()

    def close(self) -> None:
        if self.snapcheck is not None:
            self.snapcheck.close()
