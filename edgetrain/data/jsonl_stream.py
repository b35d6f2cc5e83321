"""A token stream over JSONL records read from disk: each record tokenised on its own, cut into windows of
next-token pairs, resumable by index.

Records (edgetrain.data.jsonl) are text (`{"text": ...}`, every token a target) or chat (`{"messages": ...}`,
rendered with the chat template; only the assistant's content and end-of-turn tokens are targets, every
other target is -100). A chat is tokenised piece by piece -- prompt text, assistant text, prompt text, ... --
so that no token straddles the boundary; that equals tokenising the whole text except where a tokenizer
would merge across it (e.g. an assistant message starting with spaces).

A record of n tokens gives n - 1 next-token pairs, cut into ceil((n - 1) / seq_len) windows of seq_len
pairs; the last window of a record is padded (inputs: the tokenizer's pad id, else its EOS id, else 0;
targets: -100), so no window mixes two records. Windows without any target (a long prompt's leading
windows, a one-token record) are left out. Text records get no BOS/EOS added, as in TextStream.

Memory: the corpus stays on disk. Building the stream reads every line once (to check it, count its
windows and digest its tokens for the fingerprint) and keeps a small index: per record its file, byte
offset, line number and CRC-32 (20 bytes), per window its record and position (8 bytes) -- O(records +
windows), a few MB for a million records. A batch reads its records' lines again, re-renders and
re-tokenises them, and keeps the last few tokenised records (windows of one record come in a row when
unshuffled). A line that changed since the index was built is an error, not other data.
"""
from __future__ import annotations

import hashlib
import zlib
from array import array
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

import torch

from edgetrain.data.batch import Batch
from edgetrain.data.chat_template import ChatTemplate, ChatTemplateError, chat_template_for
from edgetrain.data.files import describe_files, find_text_files, is_jsonl
from edgetrain.data.indexed import EpochOrder, IndexedStream
from edgetrain.data.jsonl import JsonlError, Record, iter_lines, parse_record, read_line
from edgetrain.data.tokenizer import ByteTokenizer, Tokenizer
from edgetrain.registry import EdgetrainError
from edgetrain.training.losses import IGNORE_INDEX

_CACHED_RECORDS = 8  # tokenised records kept for the next batches: enough for one record's run of windows


def padding_id(tokenizer: Tokenizer) -> int:
    """The input id of padding positions (their targets are -100, so any valid id would do): the
    tokenizer's pad id, else its EOS id, else 0."""
    for name in ("pad_token_id", "eos_token_id"):
        token_id = getattr(tokenizer, name, None)
        if isinstance(token_id, int):
            return token_id
    return 0


class JsonlStream(IndexedStream):
    """Batches of `batch_size` windows [B, seq_len] over the records of JSONL files (see the module docstring).

    `paths`: JSONL files, or directories of them (see find_text_files). `chat_template`: a Jinja string
    used for chat records instead of the tokenizer's own `chat_template`; a chat record with neither is an
    error. `vocab_size` (the model's) is checked against every token id when the stream is built.
    Windows are visited in order (file order, then line order) or in a seeded per-epoch shuffle; the windows
    of a last partial batch are left out. Batch i is a pure function of (the files' records, tokenizer,
    template, seq_len, batch_size, shuffle, seed, i), so `start_index=k` resumes exactly.
    """

    def __init__(self, paths: Sequence[str | Path] | str | Path, *, seq_len: int = 128, batch_size: int = 1,
                 tokenizer: Tokenizer | None = None, vocab_size: int | None = None,
                 chat_template: str | None = None, shuffle: bool = False, seed: int = 0,
                 epochs: int | None = None, start_index: int = 0) -> None:
        super().__init__(epochs=epochs, start_index=start_index)
        if seq_len <= 0 or batch_size <= 0:
            raise EdgetrainError(f"seq_len and batch_size must be positive (got {seq_len}, {batch_size})")
        files = find_text_files(paths)
        not_jsonl = [path for path in files if not is_jsonl(path)]
        if not_jsonl:
            raise EdgetrainError(f"JsonlStream reads *.jsonl files only, not {describe_files(not_jsonl)} "
                                 "(text_stream takes plain text)")
        self.files, self.source = files, describe_files(files)
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.seq_len, self.batch_size, self.vocab_size = seq_len, batch_size, vocab_size
        self.shuffle, self.seed = shuffle, seed
        self.pad_id = padding_id(self.tokenizer)
        if vocab_size is not None and not 0 <= self.pad_id < vocab_size:
            raise EdgetrainError(f"vocab_size must be positive and above the padding id {self.pad_id}, "
                                 f"got {vocab_size}")
        self._template_source = chat_template
        self._template: ChatTemplate | None = None
        self._cache: OrderedDict[int, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._index_records()
        self.batches_per_epoch = self.windows // batch_size
        if self.batches_per_epoch == 0:
            raise EdgetrainError(f"{self.source} gives {self.windows} windows with a target (seq_len {seq_len}): "
                                 f"too few for one batch of {batch_size}")
        self._order = EpochOrder(self.windows, shuffle=shuffle, seed=seed)

    # -- building the index: one pass over every line ---------------------------------------------------
    def _index_records(self) -> None:
        self._record_file, self._record_offset = array("I"), array("q")
        self._record_line, self._record_crc = array("I"), array("I")
        self._window_record, self._window_part = array("I"), array("I")
        digest, tokens = hashlib.sha256(), 0
        for file_number, path in enumerate(self.files):
            for line_number, offset, line in iter_lines(path):
                where = f"{path}:{line_number}"
                ids, loss = self._tokenise(parse_record(line, where), where)
                record = len(self._record_offset)
                self._record_file.append(file_number)
                self._record_offset.append(offset)
                self._record_line.append(line_number)
                self._record_crc.append(zlib.crc32(line))
                digest.update(ids.numpy().tobytes())
                digest.update(loss.numpy().tobytes())
                tokens += len(ids)
                for part in range(-(-(len(ids) - 1) // self.seq_len) if len(ids) > 1 else 0):
                    if bool(loss[part * self.seq_len + 1:(part + 1) * self.seq_len + 1].any()):
                        self._window_record.append(record)
                        self._window_part.append(part)
        self.records, self.windows = len(self._record_offset), len(self._window_record)
        self.token_count = tokens  # not `tokens`: on a TextStream that is the token tensor itself
        self._digest = digest.hexdigest()

    def _chat_template(self, where: str) -> ChatTemplate:
        if self._template is None:
            self._template = chat_template_for(self.tokenizer, self._template_source)
            if self._template is None:
                raise JsonlError(f"{where}: a chat record needs a chat template, and the tokenizer "
                                 f"({type(self.tokenizer).__name__}) has none: use a model whose "
                                 "tokenizer_config.json or GGUF carries one, or pass chat_template=")
        return self._template

    def _tokenise(self, record: Record, where: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids (int64) of a record and which of them are targets (bool)."""
        if isinstance(record, str):
            ids = torch.tensor(self.tokenizer.encode(record), dtype=torch.long)
            loss = torch.ones(len(ids), dtype=torch.bool)
        else:
            try:
                text, spans = self._chat_template(where).assistant_spans(record)
            except ChatTemplateError as exc:
                raise JsonlError(f"{where}: {exc}") from None
            # Each piece is tokenised on its own, so no token straddles a prompt/assistant boundary.
            pieces, flags, at = [], [], 0
            for start, end in spans:
                pieces += [text[at:start], text[start:end]]
                flags += [False, True]
                at = end
            pieces.append(text[at:])
            flags.append(False)
            encoded = [self.tokenizer.encode(piece) if piece else [] for piece in pieces]
            ids = torch.tensor([i for piece in encoded for i in piece], dtype=torch.long)
            loss = torch.tensor([flag for piece, flag in zip(encoded, flags) for _ in piece], dtype=torch.bool)
        if self.vocab_size is not None and len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise EdgetrainError(f"{where}: the tokenizer (vocab {self.tokenizer.vocab_size}) produced token id "
                                 f"{bad}, outside the model's vocabulary [0, {self.vocab_size})")
        return ids, loss

    # -- batches: records read back from disk -------------------------------------------------------------
    def _record_tokens(self, record: int) -> tuple[torch.Tensor, torch.Tensor]:
        if record in self._cache:
            self._cache.move_to_end(record)
            return self._cache[record]
        path = self.files[self._record_file[record]]
        where = f"{path}:{self._record_line[record]}"
        line = read_line(path, self._record_offset[record])
        if zlib.crc32(line) != self._record_crc[record]:
            raise JsonlError(f"{where}: the line changed since the stream was built; build the stream again")
        tokens = self._tokenise(parse_record(line, where), where)
        self._cache[record] = tokens
        if len(self._cache) > _CACHED_RECORDS:
            self._cache.popitem(last=False)
        return tokens

    def batch(self, index: int) -> Batch:
        epoch, within = divmod(index, self.batches_per_epoch)
        windows = self._order.items(epoch, within * self.batch_size, (within + 1) * self.batch_size).tolist()
        inputs = torch.full((len(windows), self.seq_len), self.pad_id, dtype=torch.long)
        targets = torch.full((len(windows), self.seq_len), IGNORE_INDEX, dtype=torch.long)
        for row, window in enumerate(windows):
            ids, loss = self._record_tokens(self._window_record[window])
            start = self._window_part[window] * self.seq_len
            chunk, chunk_loss = ids[start:start + self.seq_len + 1], loss[start + 1:start + self.seq_len + 1]
            pairs = len(chunk) - 1
            inputs[row, :pairs] = chunk[:-1]
            targets[row, :pairs] = torch.where(chunk_loss, chunk[1:], IGNORE_INDEX)
        return Batch(inputs, targets, index)

    def _fingerprint_fields(self) -> dict[str, Any]:
        return {"records": self.records, "windows": self.windows, "tokens": self.token_count, "sha256": self._digest,
                "tokenizer": f"{type(self.tokenizer).__name__}/{self.tokenizer.vocab_size}",
                "seq_len": self.seq_len, "batch_size": self.batch_size, "shuffle": self.shuffle, "seed": self.seed}
