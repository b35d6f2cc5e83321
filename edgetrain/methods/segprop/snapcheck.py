"""SnapCheck: a cache of detached frozen-prefix outputs, keyed by (prefix depth, batch id).

Once a prefix is committed its output for a given batch never changes, so a stage that sees the same
batches again (a fixed data order, epoch after epoch) need not run the prefix again (SegProp §3.4).
Entries live in memory up to `budget_bytes`; beyond it the least recently used are spilled to files in
`spill_dir` and read back memory-mapped (copy-on-write, so nothing a consumer does reaches the file);
beyond `disk_budget_bytes` the oldest spilled entries are dropped. Without a spill directory entries
over budget are dropped. A dropped entry is only a miss: the caller recomputes it.

Guards, so a hit is never a wrong activation:
  fingerprint  a few float64 reductions of the batch inputs, stored with the entry; a different batch
               under the same id (a shuffled stream, a wrong id) is a miss and is replaced;
  stamp        the sum of the prefix's parameter and buffer version counters; any in-place change
               of the prefix (an optimizer step, a checkpoint load) invalidates its depth;
  version      an entry handed out in memory and then modified in place by its consumer is dropped.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Hashable

import torch

from edgetrain.registry import EdgetrainError

_ALIGN = 64  # byte alignment of each tensor inside a spill file (any dtype can be viewed from it)


def input_fingerprint(inputs: torch.Tensor) -> tuple:
    """Shape, dtype and two float64 reductions (plain and position-weighted) of a batch's inputs:
    cheap on any device, and different for different real batches."""
    flat = inputs.detach().reshape(-1).to(torch.float64)
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.float64).remainder_(251).add_(1)
    sums = torch.stack([flat.sum(), (flat * weights).sum()]).cpu().tolist()
    return tuple(inputs.shape), str(inputs.dtype), *sums


def _flatten(state: Any) -> tuple[list[torch.Tensor], bool]:
    if isinstance(state, torch.Tensor):
        return [state], False
    return list(state), True


def _unflatten(tensors: list[torch.Tensor], is_tuple: bool) -> Any:
    return tuple(tensors) if is_tuple else tensors[0]


@dataclass
class _Entry:
    fingerprint: Any
    stamp: Any
    is_tuple: bool
    nbytes: int
    tensors: list[torch.Tensor] | None = None        # in memory
    versions: list[int] = field(default_factory=list)
    path: Path | None = None                          # spilled
    layout: list[tuple[torch.dtype, torch.Size, int]] = field(default_factory=list)  # dtype, shape, offset
    file_bytes: int = 0
    device: torch.device | None = None


class SnapCheck:
    def __init__(self, budget_bytes: int = 256 * 2**20, *, spill_dir: str | Path | None = "auto",
                 disk_budget_bytes: int | None = 2 * 2**30) -> None:
        if budget_bytes < 0 or (disk_budget_bytes is not None and disk_budget_bytes < 0):
            raise EdgetrainError("SnapCheck budgets must be >= 0 bytes")
        self.budget_bytes = int(budget_bytes)
        self.disk_budget_bytes = None if disk_budget_bytes is None else int(disk_budget_bytes)
        self._spill_setting = spill_dir
        self._spill_dir: Path | None = None
        self._cleanup = None
        self._entries: OrderedDict[tuple[int, Hashable], _Entry] = OrderedDict()  # LRU order, oldest first
        self.memory_bytes = 0
        self.disk_bytes = 0
        self.counts = {"hits": 0, "misses": 0, "puts": 0, "spills": 0, "evictions": 0, "disk_reads": 0,
                       "stale": 0}

    # -- lookups ------------------------------------------------------------------------------

    def get(self, depth: int, batch_id: Hashable, fingerprint: Any = None, stamp: Any = None) -> Any:
        """The cached state, or None (a miss) when absent, for another batch, or stale."""
        key = (depth, batch_id)
        entry = self._entries.get(key)
        if entry is None or not self._valid(key, entry, fingerprint, stamp):
            self.counts["misses"] += 1
            return None
        self.counts["hits"] += 1
        self._entries.move_to_end(key)
        return self._load(entry)

    def nearest(self, depth: int, batch_id: Hashable, fingerprint: Any = None,
                stamp_of: Any = None) -> tuple[int, Any] | None:
        """The deepest valid entry for this batch shallower than `depth`, as (its depth, its state):
        a new prefix depth is then built from it by running only the newly committed units.
        `stamp_of(d)` gives the current stamp of depth d."""
        for (d, b), entry in sorted(self._entries.items(), key=lambda item: -item[0][0]):
            if b != batch_id or d >= depth:
                continue
            if self._valid((d, b), entry, fingerprint, None if stamp_of is None else stamp_of(d)):
                return d, self._load(entry)
        return None

    def _valid(self, key: tuple[int, Hashable], entry: _Entry, fingerprint: Any, stamp: Any) -> bool:
        if fingerprint is not None and entry.fingerprint != fingerprint:
            self.drop(*key)
            return False
        if stamp is not None and entry.stamp != stamp:
            self.counts["stale"] += 1
            self.drop(depth=key[0])  # the prefix changed: every entry of this depth is stale
            return False
        if entry.tensors is not None and [t._version for t in entry.tensors] != entry.versions:
            self.counts["stale"] += 1
            self.drop(*key)  # its consumer wrote into it
            return False
        return True

    def _load(self, entry: _Entry) -> Any:
        if entry.tensors is not None:
            return _unflatten(entry.tensors, entry.is_tuple)
        self.counts["disk_reads"] += 1
        raw = torch.from_file(str(entry.path), shared=False, size=entry.file_bytes, dtype=torch.uint8)
        tensors = []
        for dtype, shape, offset in entry.layout:
            count = shape.numel() * torch.empty((), dtype=dtype).element_size()
            tensor = raw[offset:offset + count].view(dtype).view(shape)
            tensors.append(tensor.to(entry.device) if entry.device is not None and entry.device.type != "cpu"
                           else tensor)
        return _unflatten(tensors, entry.is_tuple)

    # -- inserting ----------------------------------------------------------------------------

    def put(self, depth: int, batch_id: Hashable, state: Any, fingerprint: Any = None, stamp: Any = None) -> None:
        tensors, is_tuple = _flatten(state)
        tensors = [t.detach() for t in tensors]
        self.drop(depth, batch_id)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        entry = _Entry(fingerprint, stamp, is_tuple, nbytes, tensors, [t._version for t in tensors],
                       device=tensors[0].device if tensors else None)
        self._entries[(depth, batch_id)] = entry
        self.memory_bytes += nbytes
        self.counts["puts"] += 1
        self._enforce_budgets()

    def _enforce_budgets(self) -> None:
        for key in list(self._entries):
            if self.memory_bytes <= self.budget_bytes:
                break
            entry = self._entries[key]
            if entry.tensors is None:
                continue
            if self._spill_directory() is not None:
                self._spill(key, entry)
            else:
                self.counts["evictions"] += 1
                self.drop(*key)
        if self.disk_budget_bytes is not None:
            for key in list(self._entries):
                if self.disk_bytes <= self.disk_budget_bytes:
                    break
                if self._entries[key].path is not None:
                    self.counts["evictions"] += 1
                    self.drop(*key)

    def _spill_directory(self) -> Path | None:
        if self._spill_dir is None and self._spill_setting is not None:
            if self._spill_setting == "auto":
                path = Path(tempfile.mkdtemp(prefix="edgetrain-snapcheck-"))
                self._cleanup = weakref.finalize(self, shutil.rmtree, str(path), ignore_errors=True)
            else:
                path = Path(self._spill_setting)
                path.mkdir(parents=True, exist_ok=True)
            self._spill_dir = path
        return self._spill_dir

    def _spill(self, key: tuple[int, Hashable], entry: _Entry) -> None:
        directory = self._spill_directory()
        assert directory is not None and entry.tensors is not None
        path = directory / f"d{key[0]}-{abs(hash(key[1])):x}-{id(entry):x}.bin"
        layout, offset = [], 0
        with open(path, "wb") as handle:
            for tensor in entry.tensors:
                data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
                padding = (-offset) % _ALIGN
                handle.write(b"\0" * padding)
                offset += padding
                layout.append((tensor.dtype, tensor.shape, offset))
                handle.write(memoryview(data))
                offset += data.nbytes
        entry.path, entry.layout, entry.file_bytes = path, layout, max(offset, 1)
        if offset == 0:  # torch.from_file cannot map an empty file
            path.write_bytes(b"\0")
        entry.tensors, entry.versions = None, []
        self.memory_bytes -= entry.nbytes
        self.disk_bytes += entry.nbytes
        self.counts["spills"] += 1

    # -- dropping -----------------------------------------------------------------------------

    def drop(self, depth: int | None = None, batch_id: Hashable = None) -> None:
        """Drop one entry (depth and batch id), a depth (batch_id None) or everything (both None)."""
        if depth is not None and batch_id is not None:
            keys = [(depth, batch_id)] if (depth, batch_id) in self._entries else []
        else:
            keys = [k for k in self._entries if depth is None or k[0] == depth]
        for key in keys:
            entry = self._entries.pop(key)
            if entry.tensors is not None:
                self.memory_bytes -= entry.nbytes
            if entry.path is not None:
                self.disk_bytes -= entry.nbytes
                try:
                    os.unlink(entry.path)
                except OSError:
                    pass

    def retain(self, depths: set[int]) -> None:
        """Keep only entries at these prefix depths (a new stage needs its own and the previous one)."""
        for depth in {k[0] for k in self._entries} - set(depths):
            self.drop(depth=depth)

    def close(self) -> None:
        self.drop()
        if self._cleanup is not None:
            self._cleanup()

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict[str, int]:
        return {**self.counts, "entries": len(self._entries), "memory_bytes": self.memory_bytes,
                "disk_bytes": self.disk_bytes,
                "spilled_entries": sum(1 for e in self._entries.values() if e.path is not None)}
