"""Streams: next-token alignment, exact resume from an index, seeded shuffles, real data sets."""
from __future__ import annotations

import gzip
import itertools
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import edgetrain
from edgetrain.data import (STREAMS, BadBatchError, Batch, TextStream,
                            default_text_corpus, digits_stream, fashion_mnist_stream, load_digits_split,
                            load_tokenizer, make_stream, parse_idx, read_idx, text_stream, validate_batch)
from edgetrain.data.fashion_mnist import FASHION_MNIST_DIR


def test_text_targets_are_next_tokens():
    stream = text_stream(seq_len=16, batch_size=3)
    batch = next(iter(stream))
    assert batch.inputs.shape == batch.targets.shape == (3, 16)
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])
    corpus = default_text_corpus().encode("utf-8")
    assert bytes(batch.inputs[0].tolist()) == corpus[:16]
    assert batch.targets[0, -1] == corpus[16]


@pytest.mark.parametrize("shuffle", [False, True])
def test_text_resume_from_index_matches_uninterrupted(shuffle):
    straight = list(itertools.islice(text_stream(seq_len=8, batch_size=2, shuffle=shuffle, seed=4), 12))
    resumed = list(itertools.islice(text_stream(seq_len=8, batch_size=2, shuffle=shuffle, seed=4, start_index=7), 5))
    for a, b in zip(straight[7:], resumed):
        assert a.index == b.index and torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)


def test_text_shuffle_is_seeded_and_epochs_end():
    first = next(iter(text_stream(seq_len=8, batch_size=2, shuffle=True, seed=1))).inputs
    again = next(iter(text_stream(seq_len=8, batch_size=2, shuffle=True, seed=1))).inputs
    other = next(iter(text_stream(seq_len=8, batch_size=2, shuffle=True, seed=2))).inputs
    assert torch.equal(first, again) and not torch.equal(first, other)
    stream = TextStream("abcdefghij" * 10, seq_len=4, batch_size=2, epochs=2)
    assert len(list(stream)) == len(stream) == 2 * (100 // 5 // 2)


def test_text_files_and_errors(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 20)
    (tmp_path / "b.md").write_text("ignored")
    stream = text_stream(seq_len=8, paths=[tmp_path])
    assert bytes(next(iter(stream)).inputs[0].tolist()) == b"hello wo"
    with pytest.raises(edgetrain.EdgetrainError, match="too short for one batch"):
        TextStream("tiny", seq_len=8)
    with pytest.raises(edgetrain.EdgetrainError, match="does not exist"):
        text_stream(paths=[tmp_path / "missing.txt"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(edgetrain.EdgetrainError, match="no text files"):
        text_stream(paths=[tmp_path / "empty"])


def test_hf_tokenizer_from_checkpoint_dir(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    tokenizer = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    assert loaded.vocab_size == 3 and loaded.encode("hello world zzz") == [1, 2, 0]
    stream = TextStream("hello world " * 30, seq_len=4, tokenizer=loaded, vocab_size=3)
    assert set(next(iter(stream)).inputs.flatten().tolist()) <= {1, 2}
    assert load_tokenizer(None).encode("é") == [0xC3, 0xA9]


def test_digits_split_is_disjoint_stratified_and_filtered():
    train_x, train_y = load_digits_split("train")
    test_x, test_y = load_digits_split("test")
    assert len(train_x) + len(test_x) == 1797 and train_x.shape[1] == 64
    assert 0.0 <= float(train_x.min()) and float(train_x.max()) <= 1.0
    train_rows = {tuple(r.tolist()) for r in train_x}
    assert sum(tuple(r.tolist()) in train_rows for r in test_x) < 5  # digits has a few duplicate images
    assert torch.bincount(test_y).min() >= 34
    low_x, low_y = load_digits_split("train", classes=[0, 1, 2, 3, 4], image=True)
    assert low_x.shape[1:] == (1, 8, 8) and set(low_y.tolist()) == {0, 1, 2, 3, 4}


def test_digits_stream_resumes_exactly():
    straight = list(itertools.islice(digits_stream(batch_size=16, seed=3), 100))
    resumed = list(itertools.islice(digits_stream(batch_size=16, seed=3, start_index=55), 5))
    for a, b in zip(straight[55:], resumed):
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    # A new epoch reshuffles.
    per_epoch = digits_stream(batch_size=16).batches_per_epoch
    assert not torch.equal(straight[0].targets, straight[per_epoch].targets)


def _idx_bytes(array: np.ndarray, code: int = 0x08) -> bytes:
    header = bytes([0, 0, code, array.ndim]) + b"".join(struct.pack(">I", n) for n in array.shape)
    return header + array.astype(">u1" if code == 0x08 else ">i4").tobytes()


def test_idx_parser_plain_gzip_and_damaged(tmp_path):
    array = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    (tmp_path / "a-idx3-ubyte").write_bytes(_idx_bytes(array))
    (tmp_path / "b-idx3-ubyte.gz").write_bytes(gzip.compress(_idx_bytes(array)))
    assert np.array_equal(read_idx(tmp_path / "a-idx3-ubyte"), array)
    assert np.array_equal(read_idx(tmp_path / "b-idx3-ubyte.gz"), array)
    assert np.array_equal(parse_idx(_idx_bytes(np.array([7, -1]), 0x0C)), [7, -1])
    with pytest.raises(edgetrain.EdgetrainError, match="payload has 23 bytes"):
        parse_idx(_idx_bytes(array)[:-1], "cut")
    with pytest.raises(edgetrain.EdgetrainError, match="bad magic"):
        parse_idx(b"\x01\x00\x08\x01" + bytes(8))
    with pytest.raises(edgetrain.EdgetrainError, match="cannot read IDX"):
        (tmp_path / "c.gz").write_bytes(b"\x1f\x8b" + b"junk")
        read_idx(tmp_path / "c.gz")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_idx_parser_never_crashes(data):
    try:
        parse_idx(data)
    except edgetrain.EdgetrainError:
        pass


def test_fashion_mnist_missing_names_the_package(tmp_path):
    with pytest.raises(edgetrain.EdgetrainError, match="apt-get install dataset-fashion-mnist"):
        fashion_mnist_stream(directory=tmp_path / "nowhere")


@pytest.mark.skipif(not FASHION_MNIST_DIR.is_dir(),
                    reason="Fashion-MNIST not installed: apt-get install dataset-fashion-mnist")
def test_real_fashion_mnist():
    stream = fashion_mnist_stream("test", batch_size=100, image=True, shuffle=False)
    assert stream.features.shape == (10000, 1, 28, 28) and len(stream.labels) == 10000
    assert torch.bincount(stream.labels).tolist() == [1000] * 10
    assert len(fashion_mnist_stream("train").features) == 60000


def test_stream_registry():
    assert {"text", "digits", "fashion-mnist"} <= set(STREAMS.names())
    assert next(iter(make_stream("digits", batch_size=4))).inputs.shape == (4, 64)
    with pytest.raises(edgetrain.EdgetrainError, match="unknown stream 'cifar'"):
        make_stream("cifar")


@pytest.mark.parametrize("batch,options,message", [
    (Batch(torch.tensor([[1.0, 2.0]]), torch.tensor([[1, 2]]), 7), dict(task="lm", vocab_size=10), "batch 7: token ids must be integers"),
    (Batch(torch.tensor([[1, 300]]), torch.tensor([[1, 2]]), 3), dict(task="lm", vocab_size=256), "batch 3: token id 300 outside"),
    (Batch(torch.tensor([[1, -1]]), torch.tensor([[1, 2]]), 3), dict(task="lm", vocab_size=256), "token id -1 outside"),
    (Batch(torch.tensor([[1.0, float("nan")]]), torch.tensor([1]), 5), dict(task="classify"), "batch 5: inputs contain NaN"),
    (Batch(torch.ones(3, 2), torch.tensor([1, 0]), 1), dict(task="classify"), "3 inputs but 2 targets"),
    (Batch(torch.ones(2, 2), torch.tensor([1, 12]), 2), dict(task="classify", num_classes=10), "label outside"),
    (Batch(torch.ones(0, 2), torch.tensor([]), 0), dict(task="classify"), "empty inputs"),
    (Batch(torch.tensor([[1, 2]]), torch.tensor([[-100, -100]]), 9), dict(task="lm", vocab_size=10), "every target is ignored"),
])
def test_validate_batch_rejects(batch, options, message):
    with pytest.raises(BadBatchError, match=message):
        validate_batch(batch, **options)


def test_learner_refuses_bad_batch_before_training(tiny_lora):
    learner = edgetrain.Learner(tiny_lora(), probe=False)
    with pytest.raises(BadBatchError, match="batch 4: token id 999"):
        learner.step(Batch(torch.tensor([[1, 999]]), torch.tensor([[2, 3]]), 4))
    assert learner.steps_done == 0
