"""Resumable iteration over index-addressable batches: the part every stream shares.

A stream here is a pure function `batch(index) -> Batch` plus a count of batches per epoch. Because
batch i depends only on the stream's settings and i, a stream built with `start_index=k` yields
exactly the batches k, k+1, ... that an uninterrupted stream would, which is what resuming after
the app was killed needs (the index to resume from is the last trained `Batch.index + 1`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Iterator

import torch

from edgetrain.data.batch import Batch
from edgetrain.registry import EdgetrainError


def seeded_permutation(size: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of epoch `epoch`: a permutation that depends only on (size, seed, epoch)."""
    # One generator per (seed, epoch), never a shared RNG: the order must not depend on what ran before.
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(size, generator=generator)


class EpochOrder:
    """The visiting order of `size` items in each epoch: in order, or a seeded shuffle per epoch.

    Keeps the current epoch's permutation, so a batch costs a slice, not a fresh shuffle."""

    def __init__(self, size: int, *, shuffle: bool, seed: int) -> None:
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self._cached: tuple[int, torch.Tensor] | None = None

    def __call__(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.size)
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, seeded_permutation(self.size, self.seed, epoch))
        return self._cached[1]

    def items(self, epoch: int, start: int, stop: int) -> torch.Tensor:
        """Items [start, stop) of epoch `epoch`'s order; unshuffled, without building the whole order (a
        stream of millions of windows would otherwise make a range of them for every batch)."""
        if not self.shuffle:
            return torch.arange(start, min(stop, self.size))
        return self(epoch)[start:stop]


class IndexedStream(ABC):
    """Base of every stream: iterates `self.batch(i)` for i = start_index, start_index + 1, ...;
    `epochs=None` cycles forever. Subclasses set `batches_per_epoch` and define `batch(index)`.

    Each `iter()` starts again at `start_index` (so a finite evaluation stream can be reused);
    `position` is the index of the next batch the latest iteration will yield, i.e. start_index plus
    the number of batches it has yielded so far. Pass it as `start_index` to resume.
    """

    batches_per_epoch: int

    def __init__(self, *, epochs: int | None, start_index: int) -> None:
        if start_index < 0:
            raise EdgetrainError(f"start_index must be >= 0, got {start_index}")
        if epochs is not None and epochs < 0:
            raise EdgetrainError(f"epochs must be >= 0 or None (endless), got {epochs}")
        self.epochs, self.start_index = epochs, start_index
        self.position = start_index

    @abstractmethod
    def batch(self, index: int) -> Batch:
        """Batch number `index` (counted from 0 over all epochs), a pure function of the settings."""

    def fingerprint(self) -> dict[str, Any]:
        """What this stream feeds, as JSON-able fields: a checkpoint records it, and resuming on a stream
        whose fingerprint differs is refused (edgetrain.data.fingerprint). Cached: the data never changes."""
        if getattr(self, "_fingerprint_cache", None) is None:
            self._fingerprint_cache = {"stream": type(self).__name__, **self._fingerprint_fields()}
        return dict(self._fingerprint_cache)

    @abstractmethod
    def _fingerprint_fields(self) -> dict[str, Any]:
        """The settings batch(i) depends on, and a digest of the data."""

    @property
    def total_batches(self) -> int | None:
        """Batches in the whole stream counted from index 0; None when it cycles forever."""
        return None if self.epochs is None else self.epochs * self.batches_per_epoch

    def __len__(self) -> int:
        """Batches one iteration yields (from start_index to the end)."""
        if self.epochs is None:
            raise TypeError("an endless stream (epochs=None) has no length")
        return max(0, self.epochs * self.batches_per_epoch - self.start_index)

    def __iter__(self) -> Iterator[Batch]:
        self.position = self.start_index
        total = self.total_batches
        while total is None or self.position < total:
            batch = self.batch(self.position)
            # Advance before handing the batch out: while the caller trains on batch i the stream
            # already reports i + 1, the index a checkpoint taken after that step resumes from.
            self.position += 1
            yield batch
