"""A stream of labelled examples held in memory (digits, Fashion-MNIST, features of a frozen model)."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from edgetrain.data.batch import Batch
from edgetrain.data.fingerprint import tensors_digest
from edgetrain.data.indexed import EpochOrder, IndexedStream
from edgetrain.registry import EdgetrainError


def keep_classes(features: torch.Tensor, labels: torch.Tensor, classes: Sequence[int] | None, *,
                 num_classes: int, dataset: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Only the examples whose label is in `classes`; labels keep their original values, so a model
    pre-trained on digits 0-4 and adapted to 5-9 keeps one output per digit."""
    if classes is None:
        return features, labels
    wanted = sorted(set(int(c) for c in classes))
    unknown = [c for c in wanted if not 0 <= c < num_classes]
    if unknown or not wanted:
        raise EdgetrainError(f"{dataset} has classes 0..{num_classes - 1}; got {list(classes)}")
    keep = torch.isin(labels, torch.tensor(wanted))
    return features[keep], labels[keep]


class ArrayStream(IndexedStream):
    """Batches of (features, labels), in order or in a seeded per-epoch shuffle; `epochs=None` cycles
    forever. Batch i depends only on (data, batch_size, shuffle, seed, i), so `start_index=k` resumes
    exactly. The last partial batch of an epoch is dropped so every batch has the same shape."""

    def __init__(self, features: torch.Tensor, labels: torch.Tensor, *, batch_size: int = 32,
                 shuffle: bool = True, seed: int = 0, epochs: int | None = None, start_index: int = 0) -> None:
        super().__init__(epochs=epochs, start_index=start_index)
        if len(features) != len(labels):
            raise EdgetrainError(f"{len(features)} examples but {len(labels)} labels")
        if batch_size <= 0:
            raise EdgetrainError(f"batch_size must be positive, got {batch_size}")
        self.features, self.labels = features, labels
        self.batch_size = batch_size
        self.batches_per_epoch = len(features) // batch_size
        if self.batches_per_epoch == 0:
            raise EdgetrainError(f"{len(features)} examples: too few for one batch of {batch_size}")
        self.shuffle, self.seed = shuffle, seed
        self._order = EpochOrder(len(features), shuffle=shuffle, seed=seed)

    def _fingerprint_fields(self) -> dict[str, Any]:
        return {"examples": len(self.features), "sha256": tensors_digest(self.features, self.labels),
                "batch_size": self.batch_size, "shuffle": self.shuffle, "seed": self.seed}

    def batch(self, index: int) -> Batch:
        epoch, within = divmod(index, self.batches_per_epoch)
        rows = self._order.items(epoch, within * self.batch_size, (within + 1) * self.batch_size)
        return Batch(self.features[rows], self.labels[rows], index)

    def all_batches(self) -> list[Batch]:
        """One pass over the data in stored order (for evaluation), the last partial batch included."""
        return [Batch(self.features[i:i + self.batch_size], self.labels[i:i + self.batch_size], n)
                for n, i in enumerate(range(0, len(self.features), self.batch_size))]
