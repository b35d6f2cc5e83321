"""scikit-learn's bundled 8x8 digits (1,797 images, 10 classes): real data that needs no download."""
from __future__ import annotations

from typing import Sequence

import torch

from edgetrain.data.arrays import ArrayStream, keep_classes
from edgetrain.registry import EdgetrainError

DIGITS_SPLITS = ("train", "test")


def _load_sklearn_digits() -> tuple[torch.Tensor, torch.Tensor]:
    try:
        from sklearn.datasets import load_digits  # imported here: scikit-learn is an optional dependency
    except ImportError:
        raise EdgetrainError("the digits stream needs scikit-learn: pip install 'edgetrain[datasets]'") from None
    digits = load_digits()
    # Pixel values are 0..16 in this data set.
    features = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    return features, torch.tensor(digits.target, dtype=torch.long)


def stratified_test_mask(labels: torch.Tensor, test_fraction: float, seed: int) -> torch.Tensor:
    """True for the rows of a seeded stratified test split: the same fraction of every class."""
    if not 0.0 < test_fraction < 1.0:
        raise EdgetrainError(f"test_fraction must be in (0, 1), got {test_fraction}")
    generator = torch.Generator().manual_seed(seed)
    test_mask = torch.zeros(len(labels), dtype=torch.bool)
    for label in torch.unique(labels).tolist():  # sorted, so the generator is consumed in a fixed order
        rows = torch.nonzero(labels == label).flatten()
        rows = rows[torch.randperm(len(rows), generator=generator)]
        test_mask[rows[:round(len(rows) * test_fraction)]] = True
    return test_mask


def load_digits_split(split: str = "train", *, classes: Sequence[int] | None = None, image: bool = False,
                      test_fraction: float = 0.2, split_seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Features float32 in [0, 1] ([N, 64], or [N, 1, 8, 8] with image=True) and labels (long) of one
    side of a seeded stratified train/test split; `classes` keeps only those digits (labels unchanged).

    The split is computed on all ten digits before the class filter, so train and test stay disjoint
    for every choice of `classes`."""
    if split not in DIGITS_SPLITS:
        raise EdgetrainError(f"split must be 'train' or 'test', got {split!r}")
    features, labels = _load_sklearn_digits()
    test_mask = stratified_test_mask(labels, test_fraction, split_seed)
    keep = test_mask if split == "test" else ~test_mask
    features, labels = keep_classes(features[keep], labels[keep], classes, num_classes=10, dataset="digits")
    if image:
        features = features.reshape(-1, 1, 8, 8)
    return features, labels


def digits_stream(split: str = "train", *, batch_size: int = 32, classes: Sequence[int] | None = None,
                  image: bool = False, shuffle: bool = True, seed: int = 0, epochs: int | None = None,
                  start_index: int = 0, test_fraction: float = 0.2, split_seed: int = 0) -> ArrayStream:
    """Batches of digits: inputs [B, 64] (or [B, 1, 8, 8]) float32, targets [B] long. `seed` drives the
    per-epoch shuffle, `split_seed` the train/test split; `start_index=k` resumes at batch k."""
    features, labels = load_digits_split(split, classes=classes, image=image, test_fraction=test_fraction,
                                         split_seed=split_seed)
    return ArrayStream(features, labels, batch_size=batch_size, shuffle=shuffle, seed=seed, epochs=epochs,
                       start_index=start_index)
