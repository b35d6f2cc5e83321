"""A stream of labelled examples held in memory (digits, Fashion-MNIST, features of a frozen model)."""
from __future__ import annotations

from typing import Iterator

import torch

from edgetrain.data.batch import Batch
from edgetrain.registry import EdgetrainError


class ArrayStream:
    """Batches of (features, labels), in order or in a seeded per-epoch shuffle; `epochs=None` cycles
    forever. Batch i depends only on (data, batch_size, seed, i), so `start_index=k` resumes exactly.
    The last partial batch of an epoch is dropped so every batch has the same shape."""

    def __init__(self, features: torch.Tensor, labels: torch.Tensor, *, batch_size: int = 32,
                 shuffle: bool = True, seed: int = 0, epochs: int | None = None, start_index: int = 0) -> None:
        if len(features) != len(labels):
            raise EdgetrainError(f"{len(features)} examples but {len(labels)} labels")
        if batch_size <= 0 or start_index < 0:
            raise EdgetrainError(f"batch_size must be positive and start_index >= 0 (got {batch_size}, {start_index})")
        self.features, self.labels = features, labels
        self.batch_size = batch_size
        self.batches_per_epoch = len(features) // batch_size
        if self.batches_per_epoch == 0:
            raise EdgetrainError(f"{len(features)} examples: too few for one batch of {batch_size}")
        self.shuffle, self.seed, self.epochs, self.start_index = shuffle, seed, epochs, start_index

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(len(self.features))
        return torch.randperm(len(self.features), generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))

    def batch(self, index: int) -> Batch:
        epoch, within = divmod(index, self.batches_per_epoch)
        rows = self._order(epoch)[within * self.batch_size:(within + 1) * self.batch_size]
        return Batch(self.features[rows], self.labels[rows], index)

    def __len__(self) -> int:
        if self.epochs is None:
            raise TypeError("an endless stream has no length")
        return self.epochs * self.batches_per_epoch

    def __iter__(self) -> Iterator[Batch]:
        index = self.start_index
        while self.epochs is None or index < self.epochs * self.batches_per_epoch:
            yield self.batch(index)
            index += 1

    def all_batches(self) -> list[Batch]:
        """One pass over the data in order (for evaluation), the last partial batch included."""
        return [Batch(self.features[i:i + self.batch_size], self.labels[i:i + self.batch_size], n)
                for n, i in enumerate(range(0, len(self.features), self.batch_size))]
