"""A token stream over local text: fixed-length windows of next-token pairs, resumable by index."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

import torch

from edgetrain.data.batch import Batch
from edgetrain.data.tokenizer import ByteTokenizer, Tokenizer
from edgetrain.registry import EdgetrainError

FORTUNES_DIR = Path("/usr/share/games/fortunes")


def default_text_corpus() -> str:
    """Real English text that needs no download: the topic help pages shipped with Python."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def fortunes_corpus(directory: str | Path = FORTUNES_DIR) -> str:
    """Debian's fortune cookies (package `fortunes`), another local English corpus."""
    directory = Path(directory)
    files = sorted(p for p in directory.glob("*") if p.is_file() and not p.suffix and not p.name.startswith("."))
    if not files:
        raise EdgetrainError(f"no fortune files in {directory}; install Debian's package: apt-get install fortunes")
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)


def read_text_files(paths: Sequence[str | Path]) -> str:
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files.extend(sorted(path.rglob("*.txt")))
        elif path.is_file():
            files.append(path)
        else:
            raise EdgetrainError(f"text source {path} does not exist")
    if not files:
        raise EdgetrainError(f"no text files (*.txt) found in {', '.join(map(str, paths))}")
    return "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)


class TextStream:
    """Batches of `batch_size` windows of `seq_len + 1` tokens: inputs are the first seq_len, targets
    the last seq_len (the next token of each input).

    Windows are visited in order, or in a seeded per-epoch shuffle; `epochs=None` cycles forever.
    Batch i is a pure function of (text, seq_len, batch_size, seed, i), so `start_index=k` yields
    exactly the batches k, k+1, ... of an uninterrupted stream -- what a resumed run needs.
    """

    def __init__(self, text: str | None = None, *, paths: Sequence[str | Path] | None = None, seq_len: int = 128,
                 batch_size: int = 1, tokenizer: Tokenizer | None = None, vocab_size: int | None = None,
                 shuffle: bool = False, seed: int = 0, epochs: int | None = None, start_index: int = 0) -> None:
        if seq_len <= 0 or batch_size <= 0:
            raise EdgetrainError(f"seq_len and batch_size must be positive (got {seq_len}, {batch_size})")
        if start_index < 0:
            raise EdgetrainError(f"start_index must be >= 0, got {start_index}")
        if text is not None and paths is not None:
            raise EdgetrainError("give text or paths, not both")
        source = "the built-in corpus (pydoc topics)"
        if paths is not None:
            text, source = read_text_files(paths), ", ".join(map(str, paths))
        elif text is None:
            text = default_text_corpus()
        self.tokenizer = tokenizer or ByteTokenizer()
        if vocab_size is not None and self.tokenizer.vocab_size > vocab_size:
            raise EdgetrainError(f"the tokenizer has {self.tokenizer.vocab_size} ids but the model's vocabulary "
                                 f"has {vocab_size}")
        self.tokens = torch.tensor(self.tokenizer.encode(text), dtype=torch.long)
        self.seq_len, self.batch_size = seq_len, batch_size
        self.windows = len(self.tokens) // (seq_len + 1)
        self.batches_per_epoch = self.windows // batch_size
        if self.batches_per_epoch == 0:
            raise EdgetrainError(f"{source} has {len(self.tokens)} tokens: too short for one batch of "
                                 f"{batch_size} x {seq_len + 1} tokens")
        self.shuffle, self.seed, self.epochs, self.start_index = shuffle, seed, epochs, start_index

    def _window_order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.windows)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.windows, generator=generator)

    def batch(self, index: int) -> Batch:
        epoch, within = divmod(index, self.batches_per_epoch)
        order = self._window_order(epoch)[within * self.batch_size:(within + 1) * self.batch_size]
        span = self.seq_len + 1
        rows = torch.stack([self.tokens[w * span:(w + 1) * span] for w in order.tolist()])
        return Batch(rows[:, :-1].contiguous(), rows[:, 1:].contiguous(), index)

    def __len__(self) -> int:
        if self.epochs is None:
            raise TypeError("an endless stream has no length")
        return self.epochs * self.batches_per_epoch

    def __iter__(self) -> Iterator[Batch]:
        index = self.start_index
        while self.epochs is None or index < self.epochs * self.batches_per_epoch:
            yield self.batch(index)
            index += 1


def text_stream(seq_len: int = 128, batch_size: int = 1, **options) -> TextStream:
    """A TextStream over the built-in corpus, or `paths=[...]` / `text=...`."""
    return TextStream(seq_len=seq_len, batch_size=batch_size, **options)
