"""The one check every path that reads a file as text makes first: is it text at all?

An executable, an image, an archive or random bytes read as text would be trained on or evaluated (16,384
tokens of a 17 KB executable, without a word), so a file that is not UTF-8 text is refused by name, saying
where and why, before any model work:

- a UTF-16 or UTF-32 byte-order mark at its start (text, but not UTF-8: save it as UTF-8);
- a NUL byte anywhere (no text holds one; every binary format does, and so does UTF-16 text without a mark);
- a block of the file whose bytes are more than 1/10 invalid UTF-8 or control characters other than
  whitespace, backspace and escape (and at least 16 of them): binary data, or text in another encoding.

A few stray invalid bytes in real text (a Latin-1 "é" in a UTF-8 file) are accepted, and read as U+FFFD as
before. Blocks are checked as they are read, so a file is read once.
"""
from __future__ import annotations

import codecs
from pathlib import Path

from edgetrain.registry import EdgetrainError

__all__ = ["BinaryInputError", "TextCheck", "check_text_bytes", "check_text_file", "read_text_file"]

BLOCK_BYTES = 1 << 16   # the span over which the share of bad bytes is judged
_BAD_SHARE = 10         # more than 1/_BAD_SHARE of a block's bytes bad: not text
_BAD_MINIMUM = 16       # ... and at least this many (a short text with a few odd bytes is still text)
# C0 control characters no text holds (tab, newlines, form feed, backspace and escape are text's), and DEL.
_CONTROLS = bytes(c for c in range(32) if c not in b"\t\n\v\f\r\b\x1b") + b"\x7f"
_MARKS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"), (codecs.BOM_UTF16_LE, "UTF-16"),
          (codecs.BOM_UTF16_BE, "UTF-16"))


class BinaryInputError(EdgetrainError, ValueError):
    """A file read as text that is not UTF-8 text (binary data, or text in another encoding); the message
    names the file and what gives it away, with its byte offset."""


class TextCheck:
    """Checks a file's bytes block by block as a reader reads them (feed each block in order, then
    finish()); raises BinaryInputError at the first sign that they are not UTF-8 text."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.offset = 0                  # bytes fed so far
        self._pending = b""              # a multi-byte character cut by the end of the last block
        self._window, self._bad, self._first_bad = 0, 0, None

    def feed(self, block: bytes) -> None:
        if self.offset == 0:
            for mark, encoding in _MARKS:
                if block.startswith(mark):
                    raise BinaryInputError(f"{self.source} is {encoding} text (it starts with a {encoding} byte-order "
                                           "mark), not UTF-8: save it as UTF-8")
        nul = block.find(b"\0")
        if nul >= 0:
            raise BinaryInputError(f"{self.source} is binary, not text: it holds a NUL byte at byte offset "
                                   f"{self.offset + nul}")
        view = memoryview(block)
        for at in range(0, len(block), BLOCK_BYTES):  # in slices: a reader's 1 MiB block is not copied whole
            piece = view[at:at + BLOCK_BYTES]
            start = self.offset - len(self._pending)
            data = self._pending + piece
            self.offset += len(piece)
            self._pending = self._count(data, start, final=False)

    def finish(self) -> None:
        if self._pending:
            self._count(self._pending, self.offset - len(self._pending), final=True)
            self._pending = b""
        self._judge()

    def _count(self, data: bytes, start: int, final: bool) -> bytes:
        """Count the bad bytes of `data` (at file offset `start`) into windows of BLOCK_BYTES, judging each
        full one; returns an incomplete character at its end, for the next block to complete."""
        view, position = memoryview(data), 0
        while position < len(data):
            end = min(len(data), position + BLOCK_BYTES - self._window)
            piece = view[position:end]
            raw = bytes(piece)
            controls = len(raw) - len(raw.translate(None, _CONTROLS))
            if controls:
                self._bad += controls
                first = min(raw.find(bytes([c])) for c in _CONTROLS if bytes([c]) in raw)
                self._first_bad = start + position + first if self._first_bad is None else self._first_bad
            used = self._invalid(piece, start + position, final or end < len(data))
            self._window += used
            position += used
            if used < len(piece):  # an incomplete character at the very end of the data
                return bytes(view[position:])
            if self._window >= BLOCK_BYTES:
                self._judge()
        return b""

    def _invalid(self, piece: memoryview, start: int, final: bool) -> int:
        """Count the bytes of `piece` in invalid UTF-8 sequences; the bytes consumed (all but a trailing
        incomplete character when not `final`)."""
        position = 0
        while position < len(piece):
            try:
                _, used = codecs.utf_8_decode(piece[position:], "strict", final)
                return position + used
            except UnicodeDecodeError as exc:
                self._bad += exc.end - exc.start
                if self._first_bad is None:
                    self._first_bad = start + position + exc.start
                position += exc.end
                if self._bad * _BAD_SHARE > BLOCK_BYTES:  # this window fails whatever follows: stop reading
                    self._window += position
                    self._judge()
        return position

    def _judge(self) -> None:
        """Refuse the window read since the last judgement if too many of its bytes are bad; start a new one."""
        if self._bad >= _BAD_MINIMUM and self._bad * _BAD_SHARE > self._window:
            raise BinaryInputError(
                f"{self.source} is binary or not UTF-8 text: {self._bad} of {self._window} bytes there are invalid "
                f"UTF-8 or control characters (the first at byte offset {self._first_bad}); save text as UTF-8")
        self._window, self._bad, self._first_bad = 0, 0, None


def check_text_bytes(data: bytes, source: str) -> None:
    """BinaryInputError unless `data` (all of `source`) is UTF-8 text."""
    check = TextCheck(source)
    check.feed(data)
    check.finish()


def check_text_file(path: str | Path, block_bytes: int = BLOCK_BYTES) -> Path:
    """`path`, after reading it through once: BinaryInputError unless it is UTF-8 text."""
    path = Path(path)
    check = TextCheck(str(path))
    with open(path, "rb") as handle:
        while block := handle.read(block_bytes):
            check.feed(block)
    check.finish()
    return path


def read_text_file(path: str | Path) -> str:
    """The text of `path` (a stray invalid byte read as U+FFFD), or BinaryInputError when it is not text."""
    data = Path(path).read_bytes()
    check_text_bytes(data, str(path))
    return data.decode("utf-8", errors="replace")
