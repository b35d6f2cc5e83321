"""Issue 40: binary data read as text.

`edgetrain eval --data` on 17 KB of an executable evaluated 16,384 tokens of it without a word. Every path that
reads a file as text shares one check (edgetrain.data.binary): the text stream that `train` and `eval` read,
the JSONL reader, `read_text_files`, and `edgetrain personalise add`. A file that is not UTF-8 text is a
BinaryInputError naming the file and what gives it away (a NUL byte, a UTF-16 mark, the share of invalid
bytes, with a byte offset), before any training step or evaluation; real UTF-8 text, non-ASCII included, is
read as before. (`edgetrain generate` takes its prompt as an argument, not a file.)
"""
from __future__ import annotations

import codecs
import gzip
import json
import random
import shutil
import struct
import sys
import zlib
from pathlib import Path

import pytest

from edgetrain.cli import main
from edgetrain.data import BinaryInputError, read_text_files, text_stream
from edgetrain.registry import EdgetrainError
from fault_tally import attempt, record, refused

TEXT = "text inputs"
GOOD_TEXT = ("Grüße aus Köln! Ünïcödé, 世界, café crème brûlée — naïve résumé ✓ 😀 "
             "and plain English sentences about the weather on the phone.\n") * 40


def _png() -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 8, 8, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(bytes(range(256)) * 4)) + chunk(b"IEND", b""))


def _executable() -> bytes:
    for candidate in ("/bin/ls", "/usr/bin/env", sys.executable):
        if Path(candidate).is_file():
            return Path(candidate).read_bytes()
    pytest.skip("no executable to copy")


# name: the bytes of a file given as text that is not text
HOSTILE = {
    "executable": lambda: _executable(),
    "executable-17k": lambda: _executable()[:17 * 1024],
    "random-bytes": lambda: random.Random(0).randbytes(20_000),
    "random-bytes-without-nul": lambda: random.Random(1).randbytes(40_000).replace(b"\0", b"")[:20_000],
    "gzip": lambda: gzip.compress(GOOD_TEXT.encode() * 4, mtime=0),
    "png": _png,
    "utf-16-with-mark": lambda: GOOD_TEXT.encode("utf-16"),
    "utf-16-without-mark": lambda: GOOD_TEXT.encode("utf-16-le"),
    "utf-32": lambda: GOOD_TEXT.encode("utf-32"),
    "one-nul-in-the-middle": lambda: (GOOD_TEXT[:2000] + "\0" + GOOD_TEXT[2000:]).encode(),
    "cp1251-text": lambda: ("Привет, мир! Это текст в другой кодировке, не в UTF-8. " * 60).encode("cp1251"),
    "control-characters": lambda: bytes(b if i % 4 else 7 for i, b in enumerate(b"plain text, mostly " * 300)),
    "binary-after-a-megabyte-of-text": lambda: b"text that goes on. " * 60_000 + bytes(range(256)) * 40,
}

# name: (bytes of real text, its text as read)
GOOD = {
    "utf-8-non-ascii": (GOOD_TEXT.encode(), GOOD_TEXT),
    "utf-8-with-mark": (codecs.BOM_UTF8 + GOOD_TEXT.encode(), "\ufeff" + GOOD_TEXT),
    "a-few-stray-latin-1-bytes": (GOOD_TEXT.encode().replace(b"weather", b"w\xe9ather", 3),
                                  GOOD_TEXT.replace("weather", "w\ufffdather", 3)),
}


def _file(tmp_path: Path, name: str, data: bytes, suffix: str = ".txt") -> Path:
    path = tmp_path / f"{name}{suffix}"
    path.write_bytes(data)
    return path


def _jsonl(tmp_path: Path, name: str, data: bytes) -> Path:
    """A JSONL file whose first record is good and whose rest is `data` (a corpus with a bad file appended)."""
    return _file(tmp_path, name, json.dumps({"text": "a good first record, long enough to train on."}).encode()
                 + b"\n" + data, ".jsonl")


def _says_where(error: Exception, path: Path) -> bool:
    return str(path) in str(error)


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_the_text_stream_refuses_a_file_that_is_not_text(name, tmp_path):
    path = _file(tmp_path, name, HOSTILE[name]())
    error = refused(TEXT, lambda: text_stream(16, 2, paths=[path]))
    assert isinstance(error, BinaryInputError) and _says_where(error, path), error
    assert "byte offset" in str(error) or "byte-order mark" in str(error)


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_read_text_files_refuses_a_file_that_is_not_text(name, tmp_path):
    path = _file(tmp_path, name, HOSTILE[name]())
    error = refused(TEXT, lambda: read_text_files([path]))
    assert isinstance(error, BinaryInputError) and _says_where(error, path), error


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_the_jsonl_reader_refuses_a_file_that_is_not_text(name, tmp_path):
    raw = _file(tmp_path, name, HOSTILE[name](), ".jsonl")
    error = refused(TEXT, lambda: text_stream(16, 1, paths=[raw]))
    assert isinstance(error, BinaryInputError) and _says_where(error, raw), error
    (tmp_path / "appended").mkdir()
    appended = _jsonl(tmp_path / "appended", name, HOSTILE[name]())
    error = refused(TEXT, lambda: text_stream(16, 1, paths=[appended]))
    assert isinstance(error, BinaryInputError) and _says_where(error, appended), error


@pytest.mark.parametrize("name", sorted(GOOD))
def test_real_text_is_read_as_before_by_every_reader(name, tmp_path):
    data, text = GOOD[name]
    path = _file(tmp_path, name, data)
    attempt(TEXT, lambda: read_text_files([path]), sound=lambda read: read == text)
    # The byte tokenizer's stream: one token per byte of the text as read.
    attempt(TEXT, lambda: text_stream(16, 2, paths=[path]),
            sound=lambda stream: len(stream.tokens) == len(text.encode()))
    jsonl = _file(tmp_path, name, (json.dumps({"text": text}) + "\n").encode(), ".jsonl")
    attempt(TEXT, lambda: text_stream(16, 1, paths=[jsonl]), sound=lambda stream: stream.batches_per_epoch > 0)


# -- the commands, in-process through edgetrain.cli.main --------------------------------------------------

def _cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


def _cli_refused(capsys, path: Path, *argv: str) -> None:
    """The command exits 2 with one line naming the file, no traceback, counted as refused."""
    code, err = _cli(capsys, *argv)
    if code == 2 and str(path) in err and "Traceback" not in err and len(err.strip().splitlines()) == 1:
        record(TEXT, "refused")
        return
    record(TEXT, "unhandled" if "Traceback" in err else "silently wrong")
    pytest.fail(f"{' '.join(argv)}: exit {code}, {err[-2000:]}")


CLI_CASES = ["executable-17k", "random-bytes", "gzip", "png", "utf-16-with-mark", "one-nul-in-the-middle",
             "cp1251-text"]


@pytest.mark.parametrize("name", CLI_CASES)
def test_eval_refuses_binary_data_by_name(name, tmp_path, capsys):
    path = _file(tmp_path, name, HOSTILE[name]())
    _cli_refused(capsys, path, "eval", "--model", "tiny", "--data", str(path), "--seq", "16", "--batch", "2", "--quiet")


@pytest.mark.parametrize("name", CLI_CASES)
def test_train_refuses_binary_data_by_name_before_any_step(name, tmp_path, capsys):
    path = _file(tmp_path, name, HOSTILE[name]())
    checkpoints = tmp_path / "ckpt"
    _cli_refused(capsys, path, "train", "--model", "tiny", "--files", str(path), "--steps", "2", "--seq", "16",
                 "--batch", "2", "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1", "--quiet")
    assert not list(checkpoints.glob("step-*")), "a step ran on binary data"


@pytest.mark.parametrize("name", CLI_CASES)
def test_personalise_add_refuses_binary_data_by_name_and_adds_nothing(name, tmp_path, capsys):
    from edgetrain.personalise import Store

    path = _file(tmp_path, name, HOSTILE[name]())
    store = tmp_path / "store"
    good = _file(tmp_path, "good", GOOD_TEXT.encode())
    _cli_refused(capsys, path, "personalise", "add", "--store", str(store), str(good), str(path))
    if store.exists():
        with Store(str(store)) as examples:
            assert examples.count()[0] == 0


def test_the_commands_read_real_non_ascii_text(tmp_path, capsys):
    path = _file(tmp_path, "good", GOOD_TEXT.encode())
    for argv in (["eval", "--model", "tiny", "--data", str(path), "--seq", "16", "--batch", "2", "--max-batches", "2",
                  "--quiet"],
                 ["train", "--model", "tiny", "--files", str(path), "--steps", "1", "--seq", "16", "--batch", "2",
                  "--quiet"],
                 ["personalise", "add", "--store", str(tmp_path / "store"), str(path)]):
        attempt(TEXT, lambda: _cli(capsys, *argv), sound=lambda result: result[0] == 0)


def test_every_refusal_is_an_edgetrain_error():
    assert issubclass(BinaryInputError, EdgetrainError) and issubclass(BinaryInputError, ValueError)
