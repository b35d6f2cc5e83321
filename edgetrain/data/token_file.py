"""Plain-text files tokenised piece by piece into a token file on disk, read back memory-mapped: a text
corpus of any size trains without its text or its token ids held in memory.

The files are read as one running text (joined by blank lines, invalid UTF-8 as U+FFFD) in pieces of about
64 Ki characters (a Rust BPE's working memory grows with the string it encodes: ~50 MiB for 460 K
characters, a few MiB for a piece), cut only between a line that ends in a non-space character and a line that starts with one. A
byte-level BPE splits its pre-tokens there (the newline is a pre-token of its own or ends the one before it,
never starts the next), so the pieces' tokens are the whole text's tokens. A tokenizer that merges across such
a cut -- one that marks the start of every encoded string, like a SentencePiece "first" prefix -- would be
told apart: each cut is checked by tokenising the lines on both sides of it together and apart, and where they
differ the text is not cut there (the piece grows instead, up to the whole corpus: what tokenising whole
cost before).

The ids go to an unlinked temporary file (in $EDGETRAIN_CACHE's directory, else the platform's user cache,
not /tmp, which is often memory-backed) in the narrowest integer dtype that holds the vocabulary; the file
disappears with the stream. Their pages are the kernel's to drop and read again, so a batch costs the
windows it reads. While the file is written its sha256 (as tensors_digest would give it), lowest and highest
id are kept, so nothing reads the corpus back to check or fingerprint it.
"""
from __future__ import annotations

import codecs
import hashlib
import logging
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator, Sequence

import numpy as np
import torch

from edgetrain.data.binary import TextCheck
from edgetrain.data.tokenizer import ByteTokenizer, Tokenizer
from edgetrain.registry import EdgetrainError

log = logging.getLogger(__name__)

READ_BLOCK_BYTES = 1 << 20
PIECE_CHARS = 1 << 16  # characters tokenised at once (module docstring)
FILE_SEPARATOR = "\n\n"  # between files, as the whole-text join always had
# A cut: after "\n" that follows a non-space character, before a non-space character.
_CUT = re.compile(r"(?<=\S\n)(?=\S)")


def token_dtype(tokenizer: Tokenizer) -> torch.dtype:
    """The narrowest integer dtype that holds every id of the tokenizer's vocabulary."""
    if tokenizer.vocab_size <= 256:
        return torch.uint8
    return torch.int32 if tokenizer.vocab_size < 2 ** 31 else torch.long


def running_text(files: Sequence[Path], block_bytes: int = READ_BLOCK_BYTES) -> Iterator[str]:
    """The files' text, joined by blank lines, in blocks of about `block_bytes` (decoded incrementally, so a
    block boundary inside a multi-byte character decodes as reading the file whole would)."""
    for number, path in enumerate(files):
        if number:
            yield FILE_SEPARATOR
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        check = TextCheck(str(path))  # a file that is not text is refused by name as it is read
        try:
            with open(path, "rb") as handle:
                while block := handle.read(block_bytes):
                    check.feed(block)
                    yield decoder.decode(block)
        except OSError as exc:
            raise EdgetrainError(f"cannot read text file {path}: {exc}") from exc
        check.finish()
        yield decoder.decode(b"", final=True)


class _Pieces:
    """Cuts running text into pieces that tokenise as the whole text would (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, piece_chars: int) -> None:
        self.tokenizer, self.piece_chars = tokenizer, piece_chars
        self.exact = type(tokenizer) is ByteTokenizer  # bytes: any cut is exact
        self.refused_cuts = 0

    def _cut_is_exact(self, left: str, right: str) -> bool:
        if self.exact:
            return True
        last_line = left[left.rfind("\n", 0, len(left) - 1) + 1:]
        end = right.find("\n")
        first_line = right if end < 0 else right[:end + 1]
        encode = self.tokenizer.encode
        if encode(last_line + first_line) == encode(last_line) + encode(first_line):
            return True
        self.refused_cuts += 1
        return False

    def __call__(self, blocks: Iterator[str]) -> Iterator[str]:
        pending = ""
        for block in blocks:
            pending += block
            if len(pending) < self.piece_chars:
                continue
            cut = self._last_exact_cut(pending)
            if cut:
                yield pending[:cut]
                pending = pending[cut:]
        if pending:
            yield pending

    def _last_exact_cut(self, text: str) -> int:
        """The last cut position in `text` that tokenises exactly, or 0 for none (a few tries, latest first)."""
        cuts = [match.start() for match in _CUT.finditer(text, max(0, len(text) - self.piece_chars // 2))]
        if not cuts:  # a very long line: look further back once
            cuts = [match.start() for match in _CUT.finditer(text)]
        for cut in reversed(cuts[-4:]):
            if self._cut_is_exact(text[:cut], text[cut:]):
                return cut
        return 0


@dataclass
class TokenFile:
    """Token ids on disk: `tokens` is a 1-D tensor memory-mapped from `handle` (kept open: the file is
    unlinked and lives as long as it)."""

    tokens: torch.Tensor
    handle: IO[bytes]
    low: int
    high: int
    sha256: str  # tensors_digest(tokens)


def tokenise_to_disk(files: Sequence[Path], tokenizer: Tokenizer, *, directory: str | Path | None = None,
                     piece_chars: int = PIECE_CHARS) -> TokenFile:
    """Tokenise `files` as one running text (see the module docstring) into a memory-mapped token file."""
    from edgetrain.models.downloads import cache_directory

    dtype = token_dtype(tokenizer)
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    directory = Path(directory) if directory is not None else cache_directory()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        handle = tempfile.TemporaryFile(dir=directory, prefix="edgetrain-tokens-")
    except OSError as exc:
        raise EdgetrainError(f"cannot create a token file in {directory} (set EDGETRAIN_CACHE to a writable "
                             f"directory): {exc}") from exc
    try:
        count, low, high = 0, None, None
        pieces = _Pieces(tokenizer, piece_chars)
        for piece in pieces(running_text(files, block_bytes=piece_chars)):
            ids = np.frombuffer(piece.encode("utf-8"), dtype=np.uint8) if pieces.exact else \
                np.asarray(tokenizer.encode(piece), dtype=np.int64)
            if ids.size == 0:
                continue
            low = int(ids.min()) if low is None else min(low, int(ids.min()))
            high = int(ids.max()) if high is None else max(high, int(ids.max()))
            handle.write(ids.astype(np_dtype, copy=False).tobytes())
            count += ids.size
        if pieces.refused_cuts:
            log.info("the tokenizer merges across %d line boundaries; the text was cut elsewhere", pieces.refused_cuts)
        handle.flush()
        digest = _file_digest(handle, dtype, count)
        # Copy-on-write: a writable array for torch, whose pages stay the file's unless written.
        tokens = torch.from_numpy(np.memmap(handle, dtype=np_dtype, mode="c", shape=(count,))) if count else \
            torch.zeros(0, dtype=dtype)
    except BaseException:
        handle.close()
        raise
    return TokenFile(tokens, handle, low or 0, high or 0, digest)


def _file_digest(handle: IO[bytes], dtype: torch.dtype, count: int) -> str:
    """tensors_digest of the file's `count` tokens, read back in blocks: dtype and shape first, then the
    bytes. (The shape leads the hash, so it cannot be hashed while the count is still unknown.)"""
    digest = hashlib.sha256(f"{dtype}{(count,)}".encode())
    handle.seek(0)
    while block := handle.read(READ_BLOCK_BYTES):
        digest.update(block)
    return digest.hexdigest()
