"""The digits stream: scaling and shapes, a disjoint stratified split, class filters, exact resume."""
from __future__ import annotations

import itertools
import sys

import pytest
import torch

from edgetrain.data import ArrayStream, digits_stream, load_digits_split, make_stream
from edgetrain.data.digits import _load_sklearn_digits, stratified_test_mask
from edgetrain.registry import EdgetrainError

pytest.importorskip("sklearn", reason="the digits stream needs scikit-learn: pip install scikit-learn")


def _same(a, b) -> bool:
    return a.index == b.index and torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)


def test_features_are_scaled_floats_and_labels_long():
    batch = next(iter(digits_stream(batch_size=16)))
    assert batch.inputs.shape == (16, 64) and batch.inputs.dtype == torch.float32
    assert batch.targets.shape == (16,) and batch.targets.dtype == torch.long
    features, labels = load_digits_split("train")
    assert float(features.min()) == 0.0 and float(features.max()) == 1.0
    assert set(labels.tolist()) == set(range(10))
    images, _ = load_digits_split("train", image=True)
    assert images.shape == (len(features), 1, 8, 8) and torch.equal(images.flatten(1), features)
    assert next(iter(digits_stream(batch_size=4, image=True))).inputs.shape == (4, 1, 8, 8)


def test_split_is_disjoint_stratified_and_seeded():
    all_features, all_labels = _load_sklearn_digits()
    mask = stratified_test_mask(all_labels, 0.2, seed=0)
    train_x, train_y = load_digits_split("train")
    test_x, test_y = load_digits_split("test")
    # The two sides are complementary row sets of the same 1,797 images: disjoint and complete.
    assert torch.equal(test_x, all_features[mask]) and torch.equal(train_x, all_features[~mask])
    assert torch.equal(test_y, all_labels[mask]) and len(train_x) + len(test_x) == 1797
    per_class_test = torch.bincount(test_y, minlength=10)
    per_class_all = torch.bincount(all_labels, minlength=10)
    assert torch.all((per_class_test - 0.2 * per_class_all).abs() <= 0.5)  # stratified: 20% of each digit
    assert torch.equal(load_digits_split("test")[0], test_x)  # the same seed, the same split
    other_x, _ = load_digits_split("test", split_seed=1)
    assert not torch.equal(other_x, test_x)
    quarter_x, _ = load_digits_split("test", test_fraction=0.25)
    assert abs(len(quarter_x) - 0.25 * 1797) < 10
    with pytest.raises(EdgetrainError, match="test_fraction"):
        load_digits_split("test", test_fraction=1.0)
    with pytest.raises(EdgetrainError, match="split must be 'train' or 'test'"):
        load_digits_split("validation")


def test_class_filter_keeps_original_labels():
    train_x, train_y = load_digits_split("train")
    low_x, low_y = load_digits_split("train", classes=range(5))
    high_x, high_y = load_digits_split("train", classes=[5, 6, 7, 8, 9])
    assert set(low_y.tolist()) == {0, 1, 2, 3, 4} and set(high_y.tolist()) == {5, 6, 7, 8, 9}
    assert len(low_x) + len(high_x) == len(train_x)
    assert torch.equal(low_x, train_x[train_y < 5])  # filtering keeps the split and the order
    test_high_x, test_high_y = load_digits_split("test", classes=[5, 6, 7, 8, 9], image=True)
    assert test_high_x.shape[1:] == (1, 8, 8) and int(test_high_y.min()) == 5
    stream = digits_stream(batch_size=8, classes=[5, 6, 7, 8, 9], epochs=1)
    assert all(int(b.targets.min()) >= 5 for b in stream)
    with pytest.raises(EdgetrainError, match="digits has classes 0..9"):
        load_digits_split("train", classes=[3, 10])


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("start", [1, 44, 45, 100])
def test_resume_from_start_index_equals_uninterrupted(shuffle, start):
    straight = list(itertools.islice(digits_stream(batch_size=32, seed=3, shuffle=shuffle), 110))
    resumed = list(itertools.islice(digits_stream(batch_size=32, seed=3, shuffle=shuffle, start_index=start),
                                    110 - start))
    assert [b.index for b in resumed] == list(range(start, 110))
    assert all(_same(a, b) for a, b in zip(straight[start:], resumed))


def test_position_and_repeatable_iteration():
    stream = digits_stream(batch_size=32, seed=2)
    iterator = iter(stream)
    for _ in range(50):
        last = next(iterator)
    assert stream.position == 50 == last.index + 1
    resumed = digits_stream(batch_size=32, seed=2, start_index=stream.position)
    assert _same(next(iterator), next(iter(resumed)))
    assert next(iter(stream)).index == 0  # each iteration starts again at start_index


def test_seeded_shuffle_per_epoch():
    first = next(iter(digits_stream(batch_size=64, seed=1)))
    assert _same(first, next(iter(digits_stream(batch_size=64, seed=1))))
    assert not torch.equal(first.targets, next(iter(digits_stream(batch_size=64, seed=2))).targets)
    stream = digits_stream(batch_size=64, seed=1)
    per_epoch = stream.batches_per_epoch
    batches = list(itertools.islice(stream, 2 * per_epoch))
    epoch0 = torch.cat([b.inputs for b in batches[:per_epoch]])
    epoch1 = torch.cat([b.inputs for b in batches[per_epoch:]])
    assert not torch.equal(epoch0, epoch1)  # a new epoch reshuffles
    # Within an epoch each example appears at most once (the rows are a permutation's slices).
    order = stream._order(0)[:per_epoch * 64]
    assert len(set(order.tolist())) == per_epoch * 64
    unshuffled = next(iter(digits_stream(batch_size=64, shuffle=False)))
    assert torch.equal(unshuffled.inputs, load_digits_split("train")[0][:64])


def test_epochs_count_and_partial_batch_dropped():
    features, _ = load_digits_split("train")
    stream = digits_stream(batch_size=100, epochs=3)
    assert stream.batches_per_epoch == len(features) // 100
    batches = list(stream)
    assert len(batches) == len(stream) == 3 * stream.batches_per_epoch
    assert all(b.inputs.shape == (100, 64) for b in batches)
    evaluation = digits_stream("test", batch_size=100).all_batches()
    assert sum(b.num_samples for b in evaluation) == len(load_digits_split("test")[0])


def test_bad_settings_are_refused():
    with pytest.raises(EdgetrainError, match="batch_size must be positive"):
        digits_stream(batch_size=0)
    with pytest.raises(EdgetrainError, match="too few for one batch"):
        digits_stream("test", batch_size=10_000)
    with pytest.raises(EdgetrainError, match="start_index must be >= 0"):
        digits_stream(start_index=-3)
    with pytest.raises(EdgetrainError, match="3 examples but 2 labels"):
        ArrayStream(torch.zeros(3, 2), torch.zeros(2, dtype=torch.long))


def test_missing_scikit_learn_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # makes the import raise ImportError
    with pytest.raises(EdgetrainError, match=r"needs scikit-learn: pip install .edgetrain\[datasets\]."):
        load_digits_split("train")


def test_digits_registered_by_name():
    batch = next(iter(make_stream("digits", batch_size=4, image=True, start_index=2)))
    assert batch.inputs.shape == (4, 1, 8, 8) and batch.index == 2
    with pytest.raises(EdgetrainError, match="unknown stream 'cifar'; known streams: digits, fashion-mnist, text"):
        make_stream("cifar")
