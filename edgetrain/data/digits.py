"""scikit-learn's bundled 8x8 digits (1,797 images): real data that needs no download."""
from __future__ import annotations

from typing import Sequence

import torch

from edgetrain.data.arrays import ArrayStream
from edgetrain.registry import EdgetrainError


def load_digits_split(split: str = "train", *, classes: Sequence[int] | None = None, image: bool = False,
                      test_fraction: float = 0.2, split_seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Features in [0, 1] ([N, 64], or [N, 1, 8, 8] with image=True) and labels, from a seeded
    stratified train/test split; `classes` keeps only those digits (labels unchanged)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise EdgetrainError("the digits stream needs scikit-learn: pip install scikit-learn") from None
    if split not in ("train", "test"):
        raise EdgetrainError(f"split must be 'train' or 'test', got {split!r}")
    digits = load_digits()
    features = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    generator = torch.Generator().manual_seed(split_seed)
    test_rows = []
    for digit in range(10):  # stratified: the same fraction of every digit goes to test
        rows = torch.nonzero(labels == digit).flatten()
        rows = rows[torch.randperm(len(rows), generator=generator)]
        test_rows.append(rows[:round(len(rows) * test_fraction)])
    test_mask = torch.zeros(len(labels), dtype=torch.bool)
    test_mask[torch.cat(test_rows)] = True
    keep = test_mask if split == "test" else ~test_mask
    if classes is not None:
        unknown = sorted(set(classes) - set(range(10)))
        if unknown:
            raise EdgetrainError(f"digits has classes 0..9; got {unknown}")
        keep &= torch.isin(labels, torch.tensor(list(classes)))
    features, labels = features[keep], labels[keep]
    if image:
        features = features.view(-1, 1, 8, 8)
    return features, labels


def digits_stream(split: str = "train", *, batch_size: int = 32, classes: Sequence[int] | None = None,
                  image: bool = False, shuffle: bool = True, seed: int = 0, epochs: int | None = None,
                  start_index: int = 0) -> ArrayStream:
    features, labels = load_digits_split(split, classes=classes, image=image)
    return ArrayStream(features, labels, batch_size=batch_size, shuffle=shuffle, seed=seed, epochs=epochs,
                       start_index=start_index)
