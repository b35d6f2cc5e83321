"""validate_batch: every malformed batch is refused with a message naming its index; good ones pass."""
from __future__ import annotations

import itertools

import pytest
import torch

import edgetrain
from edgetrain.data import BadBatchError, Batch, TextStream, digits_stream, text_stream, validate_batch
from edgetrain.data.validate import batch_expectations
from edgetrain.models.zoo import example_input
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
    # Token ids are [B, T]: a trailing feature axis or a missing batch axis would be misread by the model.
    (Batch(torch.tensor([[[1], [2]]]), torch.tensor([[[1], [2]]]), 21), dict(vocab_size=10, task="lm"),
     r"token ids must be 2-D \[B, T\] \(batch, sequence\), got shape \(1, 2, 1\)"),
    (Batch(torch.tensor([1, 2, 3]), torch.tensor([2, 3, 4]), 22), dict(vocab_size=10, task="lm"),
     r"token ids must be 2-D \[B, T\] .*got shape \(3,\)"),
    (Batch(torch.tensor([1, 2, 3]), torch.tensor([2, 3, 4]), 23), dict(task="lm"), r"must be 2-D \[B, T\]"),
    # Ids and labels are int64: anything narrower may already have wrapped.
    (Batch(torch.tensor([[1, 2]]), torch.tensor([[1, 2]], dtype=torch.int16), 25), dict(vocab_size=10),
     r"targets must be int64 \(torch.long\), got torch.int16"),
    (Batch(torch.ones(2, 2), torch.tensor([0, 1], dtype=torch.int32), 26), {}, "targets must be int64 .*torch.int32"),
    (Batch(torch.ones(2, 2), torch.tensor([0, 1], dtype=torch.uint8), 27), dict(num_classes=10),
     "targets must be int64 .*torch.uint8"),
    (Batch(torch.tensor([[1, 2]], dtype=torch.int16), _LM_TARGETS, 28), dict(vocab_size=10),
     r"token ids must be int64 \(torch.long\), got torch.int16"),
    (Batch(torch.tensor([[1, 2]], dtype=torch.int32), _LM_TARGETS, 29), dict(task="lm"), "token ids must be int64"),
    (Batch(torch.ones(2, 2), torch.tensor([[0], [1]]), 30), dict(task="classify"),
     r"class labels must be 1-D \[B\], got shape \(2, 1\)"),
    # The index is a non-negative int: it is where a resumed run continues.
    (Batch(torch.ones(2, 2), torch.tensor([0, 1]), None), {}, r"index must be a non-negative int .*got None \(NoneType\)"),
    (Batch(torch.ones(2, 2), torch.tensor([0, 1]), "7"), {}, r"index must be a non-negative int .*got '7' \(str\)"),
    (Batch(torch.ones(2, 2), torch.tensor([0, 1]), -5), {}, r"index must be a non-negative int .*got -5 \(int\)"),
    (Batch(torch.ones(2, 2), torch.tensor([0, 1]), True), {}, r"got True \(bool\)"),
    (Batch(torch.ones(2, 2), torch.tensor([0, 1]), 7.0), {}, r"got 7.0 \(float\)"),
    # Feature inputs fit the shape the model declares.
    (Batch(torch.ones(2, 63), torch.tensor([0, 1]), 31), dict(input_shape=(64,), input_size=64),
     r"inputs of shape \(2, 63\) do not fit the model: expected \[B, 64\] \(64 values per sample\)"),
    (Batch(torch.ones(2, 8, 9), torch.tensor([0, 1]), 32), dict(input_shape=(1, 8, 8), input_size=64),
     r"expected \[B, 1, 8, 8\] or \[B, 64\]"),
    (Batch(torch.ones(64), torch.tensor([0] * 64), 33), dict(input_shape=(64,), input_size=64), r"\[B, 64\]"),
    (Batch(torch.ones(2, 1, 32, 32), torch.tensor([0, 1]), 34), dict(input_shape=(3, None, None)),
     r"inputs of shape \(2, 1, 32, 32\) do not fit the model: expected \[B, 3, \*, \*\]"),
    (Batch(torch.ones(3, 32, 32), torch.tensor([0, 1, 2]), 35), dict(input_shape=(3, None, None)),
     r"expected \[B, 3, \*, \*\]"),
    (Batch(torch.ones(2, 3, 16, 16), torch.tensor([0, 1]), 36), dict(input_shape=(3, 32, 32)),
     r"expected \[B, 3, 32, 32\]"),
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
    (Batch(torch.tensor([[1, 2, 3]]), torch.tensor([1]), 4), dict(vocab_size=10, task="classify"),
     lambda b: Batch(b.inputs[..., None], b.targets, b.index)),
    # An MLP flattens: [B, 1, 8, 8] images fit a (64,) input shape; 56 values per sample do not.
    (Batch(torch.rand(2, 1, 8, 8), torch.tensor([0, 9]), 5), dict(input_shape=(64,), input_size=64),
     lambda b: Batch(b.inputs[..., :7], b.targets, b.index)),
    # A ResNet takes any image size with its channel count.
    (Batch(torch.rand(2, 3, 20, 24), torch.tensor([0, 1]), 6), dict(input_shape=(3, None, None)),
     lambda b: Batch(b.inputs[:, :2], b.targets, b.index)),
    (Batch(torch.tensor([[1, 2]]), torch.tensor([[2, 3]]), 7), dict(vocab_size=10),
     lambda b: Batch(b.inputs, b.targets.int(), b.index)),
    (Batch(torch.tensor([[1, 2]]), torch.tensor([[2, 3]]), 0), dict(vocab_size=10),
     lambda b: Batch(b.inputs, b.targets, -1)),
]


@pytest.mark.parametrize("good,options,break_it", _GOOD_AND_BROKEN)
def test_well_formed_batches_pass(good, options, break_it):
    assert validate_batch(good, **options) is None
    broken = break_it(good)
    with pytest.raises(BadBatchError, match=f"^batch {broken.index}: "):
        validate_batch(broken, **options)


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


_EXTRA_AXIS = lambda x: x[..., None]  # noqa: E731
_ONE_VALUE_SHORT = lambda x: x.flatten(1)[:, :-1]  # noqa: E731


@pytest.mark.parametrize("preset,expected,break_inputs", [
    ("tiny", dict(task="lm", vocab_size=256), _EXTRA_AXIS),
    ("transformer-text", dict(task="classify", vocab_size=256, num_classes=4), _EXTRA_AXIS),
    ("mlp-digits", dict(expect_float=True, input_size=64, input_shape=(64,), num_classes=10), _ONE_VALUE_SHORT),
    ("convnet-digits", dict(expect_float=True, input_size=64, input_shape=(1, 8, 8)), _ONE_VALUE_SHORT),
    ("vit-tiny-cifar", dict(expect_float=True, input_shape=(3, 32, 32)), lambda x: x[..., :-1]),
    ("resnet18-cifar", dict(expect_float=True, input_shape=(3, None, None)), _EXTRA_AXIS),
    ("mobilenetv3-small-cifar", dict(expect_float=True, input_shape=(3, None, None)), lambda x: x[:, :1]),
])
def test_batch_expectations_read_the_models_own_config_and_accept_its_inputs(preset, expected, break_inputs):
    model = edgetrain.load_model(preset)
    expectations = batch_expectations(model)
    assert expected.items() <= expectations.items(), expectations
    # The input the zoo itself builds for the model passes; the same input misshapen does not.
    inputs = example_input(model, batch_size=2, seq_len=8, generator=torch.Generator().manual_seed(0))
    lm = expectations["task"] == "lm"
    targets = inputs.clone() if lm else torch.tensor([0, 1])
    validate_batch(Batch(inputs, targets, 0), **expectations)
    with pytest.raises(BadBatchError, match="^batch 1: .*(2-D|do not fit the model)"):
        validate_batch(Batch(break_inputs(inputs), break_inputs(targets) if lm else targets, 1), **expectations)


def _lm_batch(index: int = 0) -> Batch:
    ids = torch.arange(2 * 9).reshape(2, 9) % 256
    return Batch(ids[:, :-1].clone(), ids[:, 1:].clone(), index)


_GOOD_LM = _lm_batch()
_MALFORMED_LM = {
    "ids [B, T, 1]": (Batch(_GOOD_LM.inputs[..., None], _GOOD_LM.targets[..., None], 0), r"2-D \[B, T\]"),
    "ids [T]": (Batch(_GOOD_LM.inputs[0], _GOOD_LM.targets[0], 0), r"2-D \[B, T\]"),
    "int16 targets": (Batch(_GOOD_LM.inputs, _GOOD_LM.targets.short(), 0), "targets must be int64"),
    "int32 targets": (Batch(_GOOD_LM.inputs, _GOOD_LM.targets.int(), 0), "targets must be int64"),
    "int16 ids": (Batch(_GOOD_LM.inputs.short(), _GOOD_LM.targets, 0), "token ids must be int64"),
    "float ids": (Batch(_GOOD_LM.inputs.float(), _GOOD_LM.targets, 0), "token ids must be integers"),
    "id past the vocabulary": (Batch(_GOOD_LM.inputs + 256, _GOOD_LM.targets, 0), "outside the vocabulary"),
    "index None": (_lm_batch(None), "index must be a non-negative int"),
    "index '7'": (_lm_batch("7"), "index must be a non-negative int"),
    "index -5": (_lm_batch(-5), "index must be a non-negative int"),
    "index True": (_lm_batch(True), "index must be a non-negative int"),
}
_GOOD_FEATURES = Batch(torch.rand(4, 64), torch.tensor([0, 9, 3, 3]), 0)
_MALFORMED_FEATURES = {
    "63 features": (Batch(_GOOD_FEATURES.inputs[:, :63], _GOOD_FEATURES.targets, 0), r"do not fit the model"),
    "integer features": (Batch(_GOOD_FEATURES.inputs.long(), _GOOD_FEATURES.targets, 0), "must be floating point"),
    "int32 labels": (Batch(_GOOD_FEATURES.inputs, _GOOD_FEATURES.targets.int(), 0), "targets must be int64"),
    "labels [B, 1]": (Batch(_GOOD_FEATURES.inputs, _GOOD_FEATURES.targets[:, None], 0), "labels must be 1-D"),
    "index -5": (Batch(_GOOD_FEATURES.inputs, _GOOD_FEATURES.targets, -5), "index must be a non-negative int"),
}
_LEARNERS = [("tiny", method, name) for method in ("bp", "mesp", "mezo", "fgd") for name in _MALFORMED_LM] + \
    [("mlp-digits", "bp", name) for name in _MALFORMED_FEATURES]


@pytest.mark.parametrize("preset,method,case", _LEARNERS)
def test_the_learner_refuses_a_malformed_batch_before_any_weight_changes(preset, method, case, tiny_lora):
    model = tiny_lora() if preset == "tiny" else edgetrain.load_model(preset)
    batch, message = (_MALFORMED_LM if preset == "tiny" else _MALFORMED_FEATURES)[case]
    learner = edgetrain.Learner(model, method=method, optimizer="adamw", probe=False)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(BadBatchError, match=message):
        learner.step(batch)
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())
    assert learner.steps_done == 0 and learner.optimizer.state_dict()["state"] == {}
    # The well-formed twin trains: the refusal was the batch's fault, not the learner's.
    assert learner.step(_GOOD_LM if preset == "tiny" else _GOOD_FEATURES).step == 1
