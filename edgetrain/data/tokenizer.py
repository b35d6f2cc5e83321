"""Tokenizers: bytes built in (ids 0..255), or a checkpoint's Hugging Face tokenizer.json."""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

from edgetrain.registry import EdgetrainError


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids: needs no vocabulary file, works with any model whose vocab >= 256."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizer.json` read with the `tokenizers` package (imported only when used)."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise EdgetrainError("reading tokenizer.json needs the 'tokenizers' package: pip install tokenizers") from None
        try:
            self._tokenizer = _Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises a plain Exception for a damaged file
            raise EdgetrainError(f"{path}: cannot read tokenizer ({exc})") from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids)


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The tokenizer.json in a checkpoint directory (or the file itself); bytes when `path` is None
    or the directory has none."""
    if path is None:
        return ByteTokenizer()
    path = Path(path)
    candidate = path / "tokenizer.json" if path.is_dir() else path
    if candidate.is_file():
        return HFTokenizer(candidate)
    if path.is_dir():
        return ByteTokenizer()
    raise EdgetrainError(f"tokenizer {path} does not exist")
