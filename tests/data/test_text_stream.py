"""Text streams: next-token alignment, exact resume, seeded shuffles, corpora, files and tokenizers."""
from __future__ import annotations

import itertools
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgetrain.data import (ByteTokenizer, HFTokenizer, TextStream, default_text_corpus, fortunes_corpus,
                            load_tokenizer, make_stream, text_stream)
from edgetrain.data.text import FORTUNES_DIR
from edgetrain.registry import EdgetrainError

# 40 windows of 5 tokens (seq_len 4) -> with batch_size 3, 13 batches per epoch: small enough that a
# few dozen batches cross several epoch boundaries.
SMALL_TEXT = "".join(chr(ord("a") + i % 26) for i in range(200))


def _same(a, b) -> bool:
    return a.index == b.index and torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)


def test_targets_are_the_next_tokens_of_the_corpus():
    stream = text_stream(seq_len=16, batch_size=3)
    batch = next(iter(stream))
    assert batch.index == 0
    assert batch.inputs.shape == batch.targets.shape == (3, 16)
    assert batch.inputs.dtype == batch.targets.dtype == torch.long
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])
    corpus = default_text_corpus().encode("utf-8")
    for row in range(3):  # unshuffled windows are consecutive slices of 17 bytes
        window = corpus[row * 17:(row + 1) * 17]
        assert bytes(batch.inputs[row].tolist()) == window[:-1]
        assert bytes(batch.targets[row].tolist()) == window[1:]


def test_shuffled_windows_keep_the_shift():
    stream = TextStream(SMALL_TEXT, seq_len=4, batch_size=3, shuffle=True, seed=3)
    tokens = stream.tokens
    for batch in itertools.islice(stream, 20):
        for inputs, targets in zip(batch.inputs, batch.targets):
            start = int(torch.nonzero(tokens[:-4].unfold(0, 4, 1).eq(inputs).all(1))[0])
            assert torch.equal(targets, tokens[start + 1:start + 5])


def test_default_corpus_is_deterministic_english():
    from pydoc_data.topics import topics

    corpus = default_text_corpus()
    assert corpus == default_text_corpus()
    assert corpus.startswith(topics[sorted(topics)[0]]) and len(corpus) > 100_000
    assert " the " in corpus


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("start", [0, 1, 12, 13, 27])
def test_resume_from_start_index_equals_uninterrupted(shuffle, start):
    options = dict(seq_len=4, batch_size=3, shuffle=shuffle, seed=4)
    straight = list(itertools.islice(TextStream(SMALL_TEXT, **options), 40))
    resumed = list(itertools.islice(TextStream(SMALL_TEXT, start_index=start, **options), 40 - start))
    assert [b.index for b in resumed] == list(range(start, 40))
    assert all(_same(a, b) for a, b in zip(straight[start:], resumed))


def test_position_counts_batches_handed_out_and_resumes():
    stream = TextStream(SMALL_TEXT, seq_len=4, batch_size=3, shuffle=True, seed=1)
    iterator = iter(stream)
    taken = [next(iterator) for _ in range(17)]
    assert stream.position == 17 == taken[-1].index + 1
    resumed = TextStream(SMALL_TEXT, seq_len=4, batch_size=3, shuffle=True, seed=1, start_index=stream.position)
    assert _same(next(iterator), next(iter(resumed)))
    # A new iteration starts again at start_index: a finite stream can be evaluated repeatedly.
    assert next(iter(stream)).index == 0 and stream.position == 1


def test_seeded_shuffle_is_deterministic_and_seeds_differ():
    def first_epoch(seed):
        stream = TextStream(SMALL_TEXT, seq_len=4, batch_size=3, shuffle=True, seed=seed)
        return torch.cat([b.inputs for b in itertools.islice(stream, stream.batches_per_epoch)])

    assert torch.equal(first_epoch(1), first_epoch(1))
    assert not torch.equal(first_epoch(1), first_epoch(2))
    in_order = TextStream(SMALL_TEXT, seq_len=4, batch_size=3)
    ordered = torch.cat([b.inputs for b in itertools.islice(in_order, in_order.batches_per_epoch)])
    # A shuffle permutes windows: the same rows, another order.
    assert not torch.equal(first_epoch(1), ordered)
    assert set(map(tuple, first_epoch(1).tolist())) <= set(map(tuple, in_order.tokens.view(-1, 5)[:, :4].tolist()))


def test_each_epoch_reshuffles_and_visits_windows_once():
    numbered = "".join(f"{w:02d}abc" for w in range(30))  # 30 distinct windows of 5 bytes, 10 batches
    stream = TextStream(numbered, seq_len=4, batch_size=3, shuffle=True, seed=0)
    assert stream.windows == 30 and stream.batches_per_epoch == 10
    batches = list(itertools.islice(stream, 20))
    epoch0 = [tuple(r) for b in batches[:10] for r in b.inputs.tolist()]
    epoch1 = [tuple(r) for b in batches[10:] for r in b.inputs.tolist()]
    assert len(set(epoch0)) == 30 and set(epoch0) == set(epoch1) and epoch0 != epoch1


def test_epochs_end_and_none_cycles_forever():
    stream = TextStream(SMALL_TEXT, seq_len=4, batch_size=3, epochs=2)
    assert len(list(stream)) == len(stream) == 2 * 13
    assert len(TextStream(SMALL_TEXT, seq_len=4, batch_size=3, epochs=2, start_index=20)) == 6
    endless = TextStream(SMALL_TEXT, seq_len=4, batch_size=3)
    batches = list(itertools.islice(endless, 100))
    assert [b.index for b in batches] == list(range(100))
    # Unshuffled, epoch 1 (batch 13 on) repeats epoch 0 with indexes still counting up.
    assert torch.equal(batches[13].inputs, batches[0].inputs) and torch.equal(batches[26].targets, batches[0].targets)
    with pytest.raises(TypeError):
        len(endless)


def test_text_files_directory_and_order(tmp_path):
    (tmp_path / "b.txt").write_text("second file " * 10)
    (tmp_path / "a.txt").write_text("first file " * 10)
    (tmp_path / "notes.md").write_text("not a text file")
    stream = text_stream(seq_len=8, paths=[tmp_path])
    assert bytes(next(iter(stream)).inputs[0].tolist()) == b"first fi"
    assert "a.txt" in stream.source and "b.txt" in stream.source
    single = text_stream(seq_len=8, paths=[tmp_path / "b.txt"])
    assert bytes(next(iter(single)).inputs[0].tolist()) == b"second f"
    assert bytes(next(iter(text_stream(seq_len=8, paths=tmp_path / "b.txt"))).inputs[0].tolist()) == b"second f"


def test_empty_or_short_text_names_the_files_and_the_length(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(EdgetrainError, match=r"empty\.txt is empty: .* 2 x \(seq_len 8 \+ 1\) = 18 tokens"):
        text_stream(seq_len=8, batch_size=2, paths=[tmp_path / "empty.txt"])
    (tmp_path / "short.txt").write_text("tiny")
    with pytest.raises(EdgetrainError, match=r"short\.txt has only 4 tokens: .* = 9 tokens"):
        text_stream(seq_len=8, paths=[tmp_path / "short.txt"])
    with pytest.raises(EdgetrainError, match="the given text is empty"):
        TextStream("", seq_len=8)
    with pytest.raises(EdgetrainError, match="does not exist"):
        text_stream(paths=[tmp_path / "missing.txt"])
    (tmp_path / "nothing").mkdir()
    with pytest.raises(EdgetrainError, match="no text files"):
        text_stream(paths=[tmp_path / "nothing"])
    with pytest.raises(EdgetrainError, match="seq_len and batch_size must be positive"):
        TextStream(SMALL_TEXT, seq_len=0)
    with pytest.raises(EdgetrainError, match="start_index must be >= 0"):
        TextStream(SMALL_TEXT, seq_len=4, start_index=-1)
    with pytest.raises(EdgetrainError, match="one of text, paths or corpus"):
        TextStream(SMALL_TEXT, corpus="pydoc")
    with pytest.raises(EdgetrainError, match="unknown text corpus 'novels'; known corpora: pydoc, fortunes"):
        text_stream(corpus="novels")


def test_large_model_vocabulary_accepts_byte_ids_and_small_one_is_refused():
    batch = next(iter(text_stream(seq_len=8, vocab_size=151_936)))
    assert int(batch.inputs.max()) < 256
    with pytest.raises(EdgetrainError, match=r"token id 1\d\d, outside the model's vocabulary \[0, 100\)"):
        TextStream(SMALL_TEXT, seq_len=4, vocab_size=100)


@pytest.mark.skipif(not FORTUNES_DIR.is_dir(), reason="fortune files not installed: apt-get install fortunes")
def test_fortunes_corpus():
    corpus = fortunes_corpus()
    assert len(corpus) > 10_000 and "\n%\n" not in corpus
    batch = next(iter(text_stream(corpus="fortunes", seq_len=32, batch_size=2)))
    assert bytes(batch.inputs[0].tolist()) == corpus.encode("utf-8")[:32]


def test_fortunes_missing_names_the_package(tmp_path):
    with pytest.raises(EdgetrainError, match="Debian's package fortunes.*apt-get install fortunes"):
        fortunes_corpus(tmp_path / "nowhere")
    (tmp_path / "cookies").write_text("a fortune\n%\nanother\n")
    (tmp_path / "cookies.dat").write_bytes(b"\0" * 24)  # strfile's index marks a fortune file
    assert fortunes_corpus(tmp_path) == "a fortune\n\nanother\n"


def test_byte_tokenizer_and_special_ids():
    tokenizer = load_tokenizer(None)
    assert isinstance(tokenizer, ByteTokenizer) and tokenizer.vocab_size == 256
    assert tokenizer.encode("é") == [0xC3, 0xA9] and tokenizer.decode([0xC3, 0xA9]) == "é"
    with_specials = ByteTokenizer(["<bos>", "<eos>"])
    assert with_specials.vocab_size == 258 and with_specials.special_ids == {"<bos>": 256, "<eos>": 257}
    assert with_specials.encode("<eos>") == list(b"<eos>")  # text never produces special ids
    assert with_specials.decode([256, *b"hi", 257]) == "<bos>hi<eos>"
    with pytest.raises(EdgetrainError, match="token id 258 outside"):
        with_specials.decode([258])
    with pytest.raises(EdgetrainError, match="distinct"):
        ByteTokenizer(["<x>", "<x>"])


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trips_any_text(text):
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert all(0 <= i < 256 for i in ids) and tokenizer.decode(ids) == text


def _write_word_level_tokenizer(directory):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    tokenizer = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))


def test_hf_tokenizer_json_from_a_checkpoint_directory(tmp_path):
    _write_word_level_tokenizer(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, HFTokenizer)
    assert loaded.vocab_size == 3 and loaded.encode("hello world zzz") == [1, 2, 0]
    assert loaded.decode([1, 2]) == "hello world"
    stream = TextStream("hello world " * 30, seq_len=4, tokenizer=loaded, vocab_size=3)
    batch = next(iter(stream))
    assert batch.inputs.tolist() == [[1, 2, 1, 2]] and batch.targets.tolist() == [[2, 1, 2, 1]]
    assert isinstance(load_tokenizer(tmp_path / "tokenizer.json"), HFTokenizer)
    (tmp_path / "empty_checkpoint").mkdir()
    assert isinstance(load_tokenizer(tmp_path / "empty_checkpoint"), ByteTokenizer)
    with pytest.raises(EdgetrainError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")


def test_damaged_tokenizer_json_is_an_edgetrain_error(tmp_path):
    pytest.importorskip("tokenizers")
    (tmp_path / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(EdgetrainError, match="cannot read tokenizer"):
        load_tokenizer(tmp_path)


def test_missing_tokenizers_package_is_named(tmp_path, monkeypatch):
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` raise ImportError
    with pytest.raises(EdgetrainError, match="needs the 'tokenizers' package: pip install tokenizers"):
        load_tokenizer(tmp_path)


def test_text_is_registered_by_name():
    stream = make_stream("text", seq_len=8, batch_size=2, start_index=3)
    assert isinstance(stream, TextStream) and next(iter(stream)).index == 3
