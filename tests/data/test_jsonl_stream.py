"""JSONL streams: text and chat records, loss on assistant tokens only, named errors with file:line, exact
resume, and a corpus that stays on disk."""
from __future__ import annotations

import gc
import itertools
import json
import tracemalloc

import pytest
import torch

from edgetrain.data import (ByteTokenizer, ChatTemplate, JsonlError, JsonlStream, TextStream, load_tokenizer,
                            text_stream, validate_batch)
from edgetrain.data.jsonl_stream import _CACHED_RECORDS
from edgetrain.registry import EdgetrainError

# SmolLM2-Instruct's ChatML template, without its default system prompt.
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6, said twice: 6."}]


def _write(path, *records) -> str:
    """Records as JSONL lines (a str is written as it is: blank lines, broken JSON)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return str(path)


def _same(a, b) -> bool:
    return a.index == b.index and torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)


def _learned_text(batch, row=0) -> bytes:
    return bytes(t for t in batch.targets[row].tolist() if t != -100)


def test_text_records_are_windowed_one_by_one_and_padded(tmp_path):
    path = _write(tmp_path / "docs.jsonl", {"text": "abcdefghijk"}, "", "   ", {"text": "xyz"})
    stream = JsonlStream(path, seq_len=8, batch_size=1, epochs=1)
    assert stream.records == 2 and stream.windows == 3  # 10 pairs -> 8 + 2, then 2 pairs
    batches = list(stream)
    assert bytes(batches[0].inputs[0].tolist()) == b"abcdefgh"
    assert bytes(batches[0].targets[0].tolist()) == b"bcdefghi"
    # The tail of a record is padded, never continued with the next record.
    assert batches[1].inputs[0].tolist() == [*b"ij", *[0] * 6]
    assert batches[1].targets[0].tolist() == [*b"jk", *[-100] * 6]
    assert batches[2].inputs[0].tolist()[:2] == [*b"xy"] and batches[2].targets[0].tolist()[:3] == [*b"yz", -100]
    for batch in batches:
        validate_batch(batch, vocab_size=256, task="lm")
        assert batch.inputs.dtype == batch.targets.dtype == torch.long


def test_chat_records_learn_exactly_the_assistant_content_and_its_end_token(tmp_path):
    path = _write(tmp_path / "chat.jsonl", {"messages": CHAT})
    stream = JsonlStream(path, seq_len=512, tokenizer=ByteTokenizer(), chat_template=CHATML, epochs=1)
    batch = next(iter(stream))
    rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CHAT).encode()
    assert bytes(batch.inputs[0, :len(rendered) - 1].tolist()) == rendered[:-1]
    # Position by position: a target exactly where the next byte is assistant content or its <|im_end|>.
    learned = torch.zeros(len(rendered), dtype=torch.bool)
    for content in (b"4.", b"6, said twice: 6."):
        start = rendered.index(b"assistant\n" + content) + len(b"assistant\n")
        learned[start:start + len(content) + len(b"<|im_end|>")] = True
    targets = batch.targets[0, :len(rendered) - 1]
    assert torch.equal(targets != -100, learned[1:])
    assert _learned_text(batch) == b"4.<|im_end|>6, said twice: 6.<|im_end|>"
    assert bool((batch.targets[0, len(rendered) - 1:] == -100).all())  # padding


def _chat_tokenizer_dir(directory, config: dict):
    """A checkpoint directory with a byte-level tokenizer.json whose ChatML markers are single special tokens
    (ids 256 and 257) and the given tokenizer_config.json."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    directory.mkdir(exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_the_models_own_template_and_end_of_turn_token_from_tokenizer_config(tmp_path):
    directory = _chat_tokenizer_dir(tmp_path / "model", {"chat_template": CHATML, "eos_token": "<|im_end|>"})
    tokenizer = load_tokenizer(directory)
    end = tokenizer.eos_token_id
    assert tokenizer.chat_template == CHATML and tokenizer.eos_token == "<|im_end|>" and end == 257
    path = _write(tmp_path / "chat.jsonl", {"messages": CHAT})
    stream = JsonlStream(path, seq_len=256, tokenizer=tokenizer, vocab_size=258, epochs=1)
    batch = next(iter(stream))
    learned = [t for t in batch.targets[0].tolist() if t != -100]
    assert learned.count(end) == 2 and learned[-1] == end  # each assistant turn ends with the one <|im_end|> id
    assert tokenizer.decode(learned) == "4.<|im_end|>6, said twice: 6.<|im_end|>"
    assert int(batch.inputs[0, -1]) == end  # no pad token: padding inputs are the EOS id
    validate_batch(batch, vocab_size=258, task="lm")


GOOD = {"text": "a good line before the bad one"}
BAD_LINES = [
    ("not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"content": "x"}', "exactly one of \"text\" or \"messages\""),
    ('{"text": "x", "messages": []}', "exactly one of \"text\" or \"messages\""),
    ('{"text": 3}', "\"text\" must be a string, got int"),
    ('{"messages": "hi"}', "\"messages\" must be a list"),
    ('{"messages": []}', "\"messages\" is empty"),
    ('{"messages": ["hi"]}', "message 0 must be an object"),
    ('{"messages": [{"role": "tool", "content": "x"}]}', "message 0 has role 'tool'; known roles"),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]}', "message 1 .* needs a string"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant message"),
]


@pytest.mark.parametrize("line, message", BAD_LINES, ids=[m[:20] for _, m in BAD_LINES])
def test_a_bad_line_is_a_named_error_with_file_and_line(tmp_path, line, message):
    path = _write(tmp_path / "data.jsonl", GOOD, "", line, GOOD)
    with pytest.raises(JsonlError, match=rf"data\.jsonl:3: .*{message}"):
        JsonlStream(path, seq_len=4, chat_template=CHATML)


def test_invalid_utf8_and_a_chat_without_any_template_are_named(tmp_path):
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"text": "\xff\xfe"}\n')
    with pytest.raises(JsonlError, match=r"bytes\.jsonl:2: not UTF-8"):
        JsonlStream(path, seq_len=4)
    chat = _write(tmp_path / "chat.jsonl", GOOD, {"messages": CHAT})
    with pytest.raises(JsonlError, match=r"chat\.jsonl:2: a chat record needs a chat template, and the tokenizer "
                                         r"\(ByteTokenizer\) has none"):
        JsonlStream(chat, seq_len=4)


def test_a_template_that_raises_names_the_line(tmp_path):
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('start with a user turn') }}{% endif %}" + CHATML
    path = _write(tmp_path / "chat.jsonl", {"messages": CHAT})
    with pytest.raises(JsonlError, match=r"chat\.jsonl:1: the chat template failed: start with a user turn"):
        JsonlStream(path, seq_len=4, chat_template=strict)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("start", [0, 1, 5, 9, 14])
def test_resume_from_start_index_equals_uninterrupted(tmp_path, shuffle, start):
    records = [{"text": f"document {i} " * (i % 4 + 1)} if i % 3 else {"messages": CHAT} for i in range(12)]
    path = _write(tmp_path / "mixed.jsonl", *records)
    options = dict(seq_len=16, batch_size=3, chat_template=CHATML, shuffle=shuffle, seed=5)
    straight = list(itertools.islice(JsonlStream(path, **options), 30))
    resumed = list(itertools.islice(JsonlStream(path, start_index=start, **options), 30 - start))
    assert [b.index for b in resumed] == list(range(start, 30))
    assert all(_same(a, b) for a, b in zip(straight[start:], resumed))


def test_same_files_same_batches_and_fingerprint_and_every_window_learns_something(tmp_path):
    long_chat = [{"role": "user", "content": "a long question " * 20}, {"role": "assistant", "content": "Yes."}]
    path = _write(tmp_path / "chat.jsonl", {"messages": long_chat}, {"messages": CHAT})
    one, two = (JsonlStream(path, seq_len=16, batch_size=2, chat_template=CHATML, epochs=1) for _ in range(2))
    assert one.fingerprint() == two.fingerprint()
    assert all(_same(a, b) for a, b in zip(one, two))
    # The long question's windows have no target and are left out; every window kept has one.
    rendered = [len(ChatTemplate(CHATML).render(chat).encode()) for chat in (long_chat, CHAT)]
    assert one.windows < sum(-(-(n - 1) // 16) for n in rendered)
    for batch in one:
        assert bool((batch.targets != -100).any(dim=1).all())
    other = JsonlStream(path, seq_len=8, batch_size=2, chat_template=CHATML)
    assert other.fingerprint()["sha256"] == one.fingerprint()["sha256"] and other.fingerprint() != one.fingerprint()


def test_the_corpus_stays_on_disk(tmp_path):
    line = {"text": "The quick brown fox jumps over the lazy dog. " * 11}  # 495 bytes a record
    path = tmp_path / "big.jsonl"
    path.write_text((json.dumps(line) + "\n") * 4000)  # 2 MB
    size = path.stat().st_size
    gc.collect()
    tracemalloc.start()
    try:
        stream = JsonlStream(path, seq_len=128, batch_size=4, epochs=1)
        retained, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert stream.records == 4000 and stream.windows == 16000
    assert retained < size / 5 and peak < size / 2, (retained, peak, size)

    def large_strings(value, depth=0):
        if isinstance(value, (str, bytes)):
            return len(value) > 1000
        if depth < 3 and isinstance(value, dict):
            return any(large_strings(v, depth + 1) for v in value.values())
        if depth < 3 and isinstance(value, (list, tuple)):
            return any(large_strings(v, depth + 1) for v in value)
        return False

    assert not large_strings(vars(stream))
    for _ in itertools.islice(stream, 300):
        pass
    assert len(stream._cache) <= _CACHED_RECORDS


def test_a_line_changed_after_indexing_is_an_error_not_other_data(tmp_path):
    path = tmp_path / "docs.jsonl"
    _write(path, {"text": "first document"}, {"text": "second document"})
    stream = JsonlStream(path, seq_len=4, epochs=1)
    path.write_text(path.read_text().replace("second", "SECOND"))  # same length: only the content says so
    batches = iter(stream)
    for _ in range(4):  # the first record's windows are read back as they were
        next(batches)
    with pytest.raises(JsonlError, match=r"docs\.jsonl:2: the line changed since the stream was built"):
        next(batches)


def test_text_stream_routes_jsonl_and_refuses_mixing(tmp_path):
    _write(tmp_path / "a.jsonl", {"text": "abcdefghijklmnop"})
    stream = text_stream(seq_len=4, paths=[tmp_path])
    assert isinstance(stream, JsonlStream) and "a.jsonl" in stream.source
    (tmp_path / "b.txt").write_text("plain text " * 10)
    with pytest.raises(EdgetrainError, match=r"separate streams: .*b\.txt are plain text, .*a\.jsonl JSONL"):
        text_stream(seq_len=4, paths=[tmp_path])
    with pytest.raises(EdgetrainError, match="TextStream reads plain text, not JSONL"):
        TextStream(paths=[tmp_path / "a.jsonl"], seq_len=4)
    with pytest.raises(EdgetrainError, match="JsonlStream reads \\*.jsonl files only"):
        JsonlStream(tmp_path / "b.txt", seq_len=4)
    with pytest.raises(EdgetrainError, match="chat_template applies to JSONL files"):
        text_stream(seq_len=4, paths=[tmp_path / "b.txt"], chat_template=CHATML)
    assert isinstance(text_stream(seq_len=4, paths=[tmp_path / "b.txt"]), TextStream)


def test_ids_outside_the_model_vocabulary_and_too_little_data_are_refused(tmp_path):
    path = _write(tmp_path / "docs.jsonl", {"text": "ok"}, {"text": "é"})
    with pytest.raises(EdgetrainError, match=r"docs\.jsonl:2: .* token id 195, outside the model's vocabulary"):
        JsonlStream(path, seq_len=4, vocab_size=128)
    with pytest.raises(EdgetrainError, match="gives 2 windows with a target .* too few for one batch of 3"):
        JsonlStream(path, seq_len=4, batch_size=3)
