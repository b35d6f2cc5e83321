"""validate_batch: every malformed batch is refused with a message naming its index; good ones pass."""
from __future__ import annotations

import itertools

import pytest
import torch

from edgetrain.data import BadBatchError, Batch, TextStream, digits_stream, text_stream, validate_batch
from edgetrain.registry import EdgetrainError

_LM_TARGETS = torch.tensor([[1, 2]])


@pytest.mark.parametrize("batch,options,message", [
    (Batch(torch.tensor([[1.0, 2.0]]), _LM_TARGETS, 7), dict(vocab_size=10), "token ids must be integers, got torch.float32"),
    (Batch(torch.tensor([[True, False]]), _LM_TARGETS, 8), dict(vocab_size=10), "token ids must be integers, got torch.bool"),
    (Batch(torch.tensor([[1, 2]]), _LM_TARGETS, 6), dict(expect_float=True), "features must be floating point, got torch.int64"),
    (Batch(torch.tensor([[1, 300]]), _LM_TARGETS, 3), dict(vocab_size=256), r"token id 300 outside the vocabulary \[0, 256\)"),
    (Batch(torch.tensor([[1, -1]]), _LM_TARGETS, 4), dict(vocab_size=256), "token id -1 outside"),
    (Batch(torch.tensor([[1.0, float("nan")]]), torch.tensor([1]), 5), dict(expect_float=True), "inputs contain NaN"),
    (Batch(torch.tensor([[1.0, float("-inf")]]), torch.tensor([1]), 11), {}, "inputs contain inf"),
    (Batch(torch.ones(3, 2), torch.tensor([1, 0]), 1), {}, "3 inputs but 2 targets"),
    (Batch(torch.ones(0, 2), torch.tensor([], dtype=torch.long), 0), {}, "empty inputs"),
    (Batch(torch.ones(2, 0), torch.tensor([1, 0]), 12), {}, "empty inputs"),
    (Batch(torch.tensor(3.0), torch.tensor(1), 13), {}, "empty inputs"),
    (Batch(torch.ones(2, 2), torch.tensor([], dtype=torch.long), 14), {}, "empty targets"),
    (Batch(torch.ones(2, 2), torch.tensor([0.0, 1.0]), 15), {}, "targets must be integer ids, got torch.float32"),
    (Batch(torch.ones(2, 2), torch.tensor([1, 12]), 2), dict(num_classes=10), r"label outside \[0, 10\) \(got 12\)"),
    (Batch(torch.ones(2, 2), torch.tensor([-1, 1]), 16), {}, r"label outside .* \(got -1\)"),
    (Batch(torch.tensor([[1, 2]]), torch.tensor([[-100, -100]]), 9), dict(vocab_size=10), "every target is ignored"),
    (Batch(torch.tensor([[1, 2]]), torch.tensor([[1, 10]]), 17), dict(vocab_size=10), "target id 10 outside"),
    (Batch(torch.tensor([[1, 2]]), torch.tensor([[1, 2, 3]]), 18), dict(task="lm"), r"LM targets \(1, 3\) must match"),
    (Batch([[1, 2]], _LM_TARGETS, 19), {}, "inputs and targets must be tensors"),
    (Batch(torch.tensor([[1 + 2j]]), torch.tensor([1]), 20), {}, "integer token ids or float features"),
])
def test_malformed_batches_are_refused_naming_the_index(batch, options, message):
    with pytest.raises(BadBatchError, match=message) as error:
        validate_batch(batch, **options)
    assert str(error.value).startswith(f"batch {batch.index}: ")
    assert isinstance(error.value, EdgetrainError)


# (good batch, options, the same batch with one value made bad): the good one must pass and its twin
# must not, so a validator that accepts everything (or refuses everything) fails here.
_GOOD_AND_BROKEN = [
    (Batch(torch.tensor([[1, 2, 3]]), torch.tensor([[2, 3, -100]]), 0), dict(vocab_size=151_936),
     lambda b: Batch(b.inputs.clone().fill_(151_936), b.targets, b.index)),
    (Batch(torch.rand(4, 64), torch.tensor([0, 9, 3, 3]), 1), dict(expect_float=True, num_classes=10),
     lambda b: Batch(b.inputs, torch.tensor([0, 10, 3, 3]), b.index)),
    (Batch(torch.tensor([[5, 6], [7, 8]]), torch.tensor([0, 1]), 2), dict(vocab_size=10, task="classify"),
     lambda b: Batch(b.inputs, torch.tensor([0, -1]), b.index)),
    (Batch(torch.rand(2, 3).half(), torch.tensor([0, 1]), 3), {},
     lambda b: Batch(b.inputs.clone().fill_(float("inf")), b.targets, b.index)),
]


@pytest.mark.parametrize("good,options,break_it", _GOOD_AND_BROKEN)
def test_well_formed_batches_pass(good, options, break_it):
    assert validate_batch(good, **options) is None
    with pytest.raises(BadBatchError, match=f"^batch {good.index}: "):
        validate_batch(break_it(good), **options)


def _stream_batches():
    yield from (("text", b, dict(vocab_size=256, expect_float=False))
                for b in itertools.islice(text_stream(seq_len=16, batch_size=2, shuffle=True), 5))
    yield from (("text-large-vocab", b, dict(vocab_size=151_936, task="lm"))
                for b in TextStream("x" * 100, seq_len=9, batch_size=2, vocab_size=151_936, epochs=1))
    yield from (("digits", b, dict(expect_float=True, num_classes=10, task="classify"))
                for b in itertools.islice(digits_stream(batch_size=8, image=True), 5))


def test_every_stream_batch_is_valid():
    seen: dict[str, int] = {}
    for name, batch, options in _stream_batches():
        validate_batch(batch, **options)  # raises BadBatchError on a malformed batch
        seen[name] = seen.get(name, 0) + 1
    # Every stream produced batches (an empty stream would pass the loop above vacuously).
    assert seen["text"] == 5 and seen["digits"] == 5 and seen["text-large-vocab"] >= 1, seen
