"""Tokenizers: UTF-8 bytes built in (ids 0..255), or a checkpoint's Hugging Face tokenizer.json.

Both expose `vocab_size`, `encode(text) -> list[int]` and `decode(ids) -> str`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol, Sequence

from edgetrain.registry import EdgetrainError
from edgetrain.utils.logs import get_logger

log = get_logger(__name__)

BYTE_VOCAB_SIZE = 256


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255: needs no vocabulary file and works with any model whose
    vocabulary has at least 256 ids (a byte id is a valid id of a 151,936-entry LM vocabulary too).

    Special tokens, when given, get the ids after the bytes: `ByteTokenizer(["<bos>", "<eos>"])` has
    vocab_size 258 with "<bos>" = 256 and "<eos>" = 257 (see `special_ids`). `encode` never produces
    them from text -- a literal "<eos>" in the text is encoded as its bytes -- so the caller adds them
    where they belong; `decode` writes them back as their names.
    """

    def __init__(self, special_tokens: Sequence[str] = ()) -> None:
        if len(set(special_tokens)) != len(special_tokens):
            raise EdgetrainError(f"special tokens must be distinct, got {list(special_tokens)}")
        self.special_tokens = tuple(special_tokens)
        self.special_ids = {name: BYTE_VOCAB_SIZE + i for i, name in enumerate(self.special_tokens)}
        self.vocab_size = BYTE_VOCAB_SIZE + len(self.special_tokens)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes decoded as UTF-8 (an invalid sequence, e.g. a cut multi-byte character, becomes U+FFFD)."""
        pieces: list[str] = []
        pending = bytearray()
        for token in ids:
            token = int(token)
            if 0 <= token < BYTE_VOCAB_SIZE:
                pending.append(token)
            elif BYTE_VOCAB_SIZE <= token < self.vocab_size:
                pieces.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
                pieces.append(self.special_tokens[token - BYTE_VOCAB_SIZE])
            else:
                raise EdgetrainError(f"token id {token} outside the byte tokenizer's ids [0, {self.vocab_size})")
        pieces.append(pending.decode("utf-8", errors="replace"))
        return "".join(pieces)


def _read_tokenizer_config(directory: Path) -> dict[str, Any]:
    """tokenizer_config.json next to a tokenizer.json, {} when there is none. Only chat formatting is read
    from it, so a damaged one is a warning, not a reason to refuse a checkpoint that trains on plain text."""
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        log.warning("%s: cannot read it (%s); the tokenizer has no chat template or special token names", path, exc)
        return {}
    if not isinstance(config, dict):
        log.warning("%s is not a JSON object; the tokenizer has no chat template or special token names", path)
        return {}
    return config


def _token_text(value: object) -> str | None:
    # tokenizer_config.json writes a special token as its text or as an AddedToken object {"content": ...}
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja (where transformers >= 4.50 writes it), else tokenizer_config.json's chat_template:
    a string, or a list of named templates of which "default" is the one used."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {item.get("name"): item.get("template") for item in template if isinstance(item, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class HFTokenizer:
    """A `tokenizer.json` read with the `tokenizers` package (imported only when one is loaded).

    From the tokenizer_config.json (or chat_template.jinja) beside it, it also keeps what chat formatting
    needs: `chat_template` and the special tokens' text `bos_token`/`eos_token`/`pad_token` and ids
    `bos_token_id`/`eos_token_id`/`pad_token_id` (None when not given)."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _RustTokenizer
        except ImportError:
            raise EdgetrainError(f"reading {path} needs the 'tokenizers' package: pip install tokenizers") from None
        self.path = Path(path)
        try:
            self._tokenizer = _RustTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises a plain Exception for a damaged file
            raise EdgetrainError(f"{path}: cannot read tokenizer ({exc})") from None
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        config = _read_tokenizer_config(self.path.parent)
        self.chat_template = _chat_template(self.path.parent, config)
        self.bos_token, self.eos_token, self.pad_token = (_token_text(config.get(f"{name}_token"))
                                                          for name in ("bos", "eos", "pad"))
        self.bos_token_id, self.eos_token_id, self.pad_token_id = (
            None if text is None else self._tokenizer.token_to_id(text)
            for text in (self.bos_token, self.eos_token, self.pad_token))

    def encode(self, text: str) -> list[int]:
        # No BOS/EOS templates: a stream of windows over running text must not get one per call.
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def model_tokenizer(model: object) -> Tokenizer:
    """The tokenizer a model was loaded with (its checkpoint's tokenizer.json, or the GGUF's vocabulary),
    else the byte tokenizer (presets, and checkpoints that ship none)."""
    tokenizer = getattr(model, "tokenizer", None)
    return tokenizer if tokenizer is not None else ByteTokenizer()


def attach_tokenizer(model: object, source: Tokenizer | str | Path, vocab_size: int) -> None:
    """Keep a checkpoint's tokenizer on the model it belongs to (as `model.tokenizer`), after checking that
    every id it can produce is a row of the model's embedding. `source` is a tokenizer, or a checkpoint
    directory: its tokenizer.json if it has one (nothing is attached when it has none)."""
    if isinstance(source, (str, Path)):
        where = str(source)
        if not (Path(source) / "tokenizer.json").is_file():
            return
        tokenizer: Tokenizer = HFTokenizer(Path(source) / "tokenizer.json")
    else:
        where, tokenizer = str(getattr(source, "path", "the tokenizer")), source
    if tokenizer.vocab_size > vocab_size:
        raise EdgetrainError(f"{where}: the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary "
                             f"only {vocab_size}: they do not belong together")
    object.__setattr__(model, "tokenizer", tokenizer)


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The tokenizer for a checkpoint: its directory's tokenizer.json (or that file itself) when
    present, the byte tokenizer when `path` is None or the directory has no tokenizer.json."""
    if path is None:
        return ByteTokenizer()
    path = Path(path)
    candidate = path / "tokenizer.json" if path.is_dir() else path
    if candidate.is_file():
        return HFTokenizer(candidate)
    if path.is_dir():
        return ByteTokenizer()
    raise EdgetrainError(f"tokenizer {path} does not exist")
