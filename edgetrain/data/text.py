"""A token stream over local text: fixed-length windows of next-token pairs, resumable by index.

Text comes from files (`paths=[...]`: files, or directories searched for *.txt and *.jsonl), a string, or
a built-in corpus that needs no download: Python's own pydoc topics ("pydoc", the default) or Debian's
fortune cookies ("fortunes", package `fortunes`). `text_stream` hands JSONL files (`{"text": ...}` and chat
records) to edgetrain.data.jsonl_stream, which streams them from disk record by record.

Memory: plain text is one running token sequence cut into windows that cross line and file boundaries.
Files are tokenised piece by piece into a token file on disk, read back memory-mapped
(edgetrain.data.token_file): neither the text nor the ids are held in memory, and a batch reads only its
windows. A string or built-in corpus, already in memory, is tokenised whole and its ids kept (one byte per
byte of text with the byte tokenizer, four bytes a token otherwise), the text dropped.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from edgetrain.data.batch import Batch
from edgetrain.data.binary import read_text_file
from edgetrain.data.fingerprint import tensors_digest
from edgetrain.data.files import describe_files, find_text_files, is_jsonl
from edgetrain.data.indexed import EpochOrder, IndexedStream
from edgetrain.data.jsonl_stream import JsonlStream
from edgetrain.data.token_file import TokenFile, token_dtype, tokenise_to_disk
from edgetrain.data.tokenizer import ByteTokenizer, Tokenizer
from edgetrain.registry import EdgetrainError

FORTUNES_DIR = Path("/usr/share/games/fortunes")
_FORTUNE_SEPARATOR = re.compile(r"^%$", re.MULTILINE)


def default_text_corpus() -> str:
    """Real English text that ships with Python: the pydoc topic pages (about 0.7 MB), joined in the
    order of their keys so the corpus is the same on every run."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def fortunes_corpus(directory: str | Path = FORTUNES_DIR) -> str:
    """Debian's fortune cookies, another local English corpus: every fortune file in `directory`
    (one with a strfile index `<name>.dat` next to it), in name order, with the "%" separator lines
    turned into blank lines."""
    directory = Path(directory)
    files = sorted(p for p in directory.glob("*")
                   if p.is_file() and not p.is_symlink() and p.with_name(p.name + ".dat").is_file()) \
        if directory.is_dir() else []
    if not files:
        raise EdgetrainError(f"no fortune files in {directory}: they come from Debian's package fortunes; "
                             "install it with `apt-get install fortunes`")
    text = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)
    return _FORTUNE_SEPARATOR.sub("", text)


TEXT_CORPORA: dict[str, Callable[[], str]] = {"pydoc": default_text_corpus, "fortunes": fortunes_corpus}


def _join_files(files: Sequence[Path]) -> str:
    return "\n\n".join(read_text_file(f) for f in files)


def read_text_files(paths: Sequence[str | Path]) -> str:
    """The contents of `find_text_files(paths)` joined by blank lines (a stray invalid UTF-8 byte becomes
    U+FFFD; a file that is not text is a BinaryInputError)."""
    return _join_files(find_text_files(paths))


def encode_compact(tokenizer: Tokenizer, text: str) -> torch.Tensor:
    """The token ids of `text` in the narrowest integer dtype that holds the tokenizer's vocabulary: one
    byte per byte of text with the byte tokenizer (read straight from the UTF-8, with no Python list of
    ints, which costs about 36 bytes a token on the way), four bytes per token otherwise. Batches widen
    them to long."""
    if type(tokenizer) is ByteTokenizer:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8) if text else \
            torch.zeros(0, dtype=torch.uint8)
    return torch.tensor(tokenizer.encode(text), dtype=token_dtype(tokenizer))


class TextStream(IndexedStream):
    """Batches of `batch_size` windows of `seq_len + 1` consecutive tokens: inputs [B, seq_len] are the
    first seq_len tokens of each window, targets [B, seq_len] the last seq_len, so targets[:, t] is
    the token after inputs[:, t]. Both are long.

    The token sequence is cut into non-overlapping windows; windows are visited in order, or in a
    seeded per-epoch shuffle (`shuffle=True`); a tail shorter than a window and the windows of a last
    partial batch are left out, so every batch has the same shape. `epochs=None` cycles forever.
    Batch i is a pure function of (text, tokenizer, seq_len, batch_size, shuffle, seed, i), so
    `start_index=k` yields exactly the batches k, k+1, ... of an uninterrupted stream.

    `vocab_size` is the model's vocabulary size; it is only used to check that every token id the
    tokenizer produced is below it (a model with 151,936 ids takes byte ids 0..255 as they are).
    """

    def __init__(self, text: str | None = None, *, paths: Sequence[str | Path] | None = None,
                 corpus: str | None = None, seq_len: int = 128, batch_size: int = 1,
                 tokenizer: Tokenizer | None = None, vocab_size: int | None = None, shuffle: bool = False,
                 seed: int = 0, epochs: int | None = None, start_index: int = 0) -> None:
        super().__init__(epochs=epochs, start_index=start_index)
        if seq_len <= 0 or batch_size <= 0:
            raise EdgetrainError(f"seq_len and batch_size must be positive (got {seq_len}, {batch_size})")
        if sum(source is not None for source in (text, paths, corpus)) > 1:
            raise EdgetrainError("give one of text, paths or corpus")
        if paths is not None:
            files = find_text_files(paths)
            if any(is_jsonl(path) for path in files):  # its JSON syntax would be trained on as text
                raise EdgetrainError(f"TextStream reads plain text, not JSONL ({describe_files(files)}): "
                                     "use text_stream(paths=...) or JsonlStream")
            self.source = describe_files(files)
        elif text is not None:
            self.source = "the given text"
        else:
            corpus = corpus or "pydoc"
            if corpus not in TEXT_CORPORA:
                raise EdgetrainError(f"unknown text corpus {corpus!r}; known corpora: {', '.join(TEXT_CORPORA)}")
            text, self.source = TEXT_CORPORA[corpus](), f"the built-in {corpus} corpus"
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self._token_file: TokenFile | None = None
        if paths is not None:
            self._token_file = tokenise_to_disk(files, self.tokenizer)
            self.tokens = self._token_file.tokens
        else:
            self.tokens = encode_compact(self.tokenizer, text)
            del text  # the tokens are all the stream keeps
        self.seq_len, self.batch_size = seq_len, batch_size
        self.vocab_size = vocab_size
        needed = batch_size * (seq_len + 1)
        if len(self.tokens) < needed:
            what = "is empty" if len(self.tokens) == 0 else f"has only {len(self.tokens)} tokens"
            raise EdgetrainError(f"{self.source} {what}: too short for one batch of {batch_size} x "
                                 f"(seq_len {seq_len} + 1) = {needed} tokens")
        if vocab_size is not None:
            self._check_ids_fit(vocab_size)
        self.windows = len(self.tokens) // (seq_len + 1)
        self.batches_per_epoch = self.windows // batch_size
        self.shuffle, self.seed = shuffle, seed
        self._order = EpochOrder(self.windows, shuffle=shuffle, seed=seed)

    def _fingerprint_fields(self) -> dict[str, Any]:
        sha256 = self._token_file.sha256 if self._token_file is not None else tensors_digest(self.tokens)
        return {"tokens": len(self.tokens), "sha256": sha256,
                "tokenizer": f"{type(self.tokenizer).__name__}/{self.tokenizer.vocab_size}",
                "seq_len": self.seq_len, "batch_size": self.batch_size, "shuffle": self.shuffle, "seed": self.seed}

    def _check_ids_fit(self, vocab_size: int) -> None:
        if vocab_size <= 0:
            raise EdgetrainError(f"vocab_size must be positive, got {vocab_size}")
        if self._token_file is not None:  # read while it was written: the corpus is not paged in again
            low, high = self._token_file.low, self._token_file.high
        else:
            low, high = int(self.tokens.min()), int(self.tokens.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise EdgetrainError(f"{self.source}: the tokenizer (vocab {self.tokenizer.vocab_size}) produced token id "
                                 f"{bad}, outside the model's vocabulary [0, {vocab_size})")

    def batch(self, index: int) -> Batch:
        epoch, within = divmod(index, self.batches_per_epoch)
        windows = self._order.items(epoch, within * self.batch_size, (within + 1) * self.batch_size)
        span = self.seq_len + 1
        rows = self.tokens[:self.windows * span].view(self.windows, span)[windows].long()
        return Batch(rows[:, :-1].contiguous(), rows[:, 1:].contiguous(), index)


def text_stream(seq_len: int = 128, batch_size: int = 1, *, text: str | None = None,
                paths: Sequence[str | Path] | None = None, corpus: str | None = None,
                tokenizer: Tokenizer | None = None, vocab_size: int | None = None, shuffle: bool = False,
                seed: int = 0, epochs: int | None = None, start_index: int = 0,
                chat_template: str | None = None) -> TextStream | JsonlStream:
    """A TextStream over the built-in pydoc corpus, or `corpus="fortunes"`, `paths=[...]` or `text=...`;
    a JsonlStream when `paths` are JSONL files (`chat_template`, a Jinja string, then overrides the
    tokenizer's for chat records). Plain text and JSONL files are not mixed in one stream: their windows
    are cut differently (running text vs record by record)."""
    options: dict[str, Any] = dict(seq_len=seq_len, batch_size=batch_size, tokenizer=tokenizer, vocab_size=vocab_size,
                                   shuffle=shuffle, seed=seed, epochs=epochs, start_index=start_index)
    if paths is not None and text is None and corpus is None:
        files = find_text_files(paths)
        jsonl = [path for path in files if is_jsonl(path)]
        if jsonl and len(jsonl) < len(files):
            raise EdgetrainError(f"give plain text and JSONL files to separate streams: "
                                 f"{describe_files([p for p in files if not is_jsonl(p)])} are plain text, "
                                 f"{describe_files(jsonl)} JSONL")
        if jsonl:
            return JsonlStream(files, chat_template=chat_template, **options)
    if chat_template is not None:
        raise EdgetrainError("chat_template applies to JSONL files with chat records, and no JSONL file was given")
    return TextStream(text, paths=paths, corpus=corpus, **options)
