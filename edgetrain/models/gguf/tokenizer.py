"""The tokenizer a GGUF file describes in its metadata, built as a `tokenizers` Tokenizer.

Supported: `tokenizer.ggml.model` "gpt2", byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen2): the token
list, the merges, control tokens (token type 3) kept whole as special tokens and user-defined ones
(type 4) as added tokens, the pre-tokenizer split chosen by `tokenizer.ggml.pre` -- the same choices
transformers makes when it reads a GGUF, so both give the same ids. SentencePiece ("llama": Gemma, Llama 2):
edgetrain.models.gguf.spm_tokenizer, split as llama.cpp splits.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from edgetrain.models.gguf.config import metadata_int, metadata_str
from edgetrain.models.gguf.reader import GGUFError, GGUFFile, StringArray, read_gguf
from edgetrain.registry import EdgetrainError

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")  # tokenizer.ggml.model values this module builds (_TOKENIZER_BUILDERS)

# Pre-tokenizer splits by `tokenizer.ggml.pre`; any other value gets GPT-2's own split (ByteLevel's regex).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
                        "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's bytes -> printable characters map (the spelling of every byte-level BPE token)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


class GGUFTokenizer:
    """A tokenizer built from GGUF metadata, with the Tokenizer protocol of edgetrain.data (vocab_size,
    encode, decode) and HFTokenizer's behaviour: no BOS/EOS added, special tokens decoded as text.

    Also carries what the file says about special tokens and chat formatting (ids may be None).
    load_gguf attaches it to the model it loads (`model.tokenizer`)."""

    def __init__(self, path: Path, backend: Any, special_ids: dict[str, int | None],
                 chat_template: str | None) -> None:
        self.path = path
        self._tokenizer = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = special_ids["bos"]
        self.eos_token_id = special_ids["eos"]
        self.unk_token_id = special_ids["unknown"]
        self.pad_token_id = special_ids["padding"]
        self.chat_template = chat_template

    def encode(self, text: str) -> list[int]:
        # No BOS/EOS templates: a stream of windows over running text must not get one per call.
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def _string_list(gguf: GGUFFile, key: str) -> Sequence[str]:
    value = gguf.metadata.get(key)
    if value is None:
        raise GGUFError(f"{gguf.path}: required metadata key {key!r} is missing")
    # A file's array of strings is a StringArray (reader.py); a list is one built in Python.
    if not isinstance(value, StringArray) and not (isinstance(value, list)
                                                   and all(isinstance(item, str) for item in value)):
        raise GGUFError(f"{gguf.path}: metadata {key!r} must be an array of strings")
    return value


def _token_types(gguf: GGUFFile, count: int) -> np.ndarray:
    value = gguf.metadata.get("tokenizer.ggml.token_type")
    if value is None:
        return np.zeros(count, dtype=np.int64)
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "iu" or len(value) != count:
        raise GGUFError(f"{gguf.path}: metadata 'tokenizer.ggml.token_type' must be an array of {count} integers "
                        "(one per token)")
    return value


def _merges(gguf: GGUFFile) -> Iterator[tuple[str, str]]:
    for index, merge in enumerate(_string_list(gguf, "tokenizer.ggml.merges")):
        # llama.cpp splits at the first space after the first character (a token may itself be " ").
        cut = merge.find(" ", 1)
        if cut < 0 or cut == len(merge) - 1:
            raise GGUFError(f"{gguf.path}: tokenizer.ggml.merges[{index}] = {merge!r} is not two tokens "
                            "separated by a space")
        yield merge[:cut], merge[cut + 1:]


def _special_ids(gguf: GGUFFile, count: int) -> dict[str, int | None]:
    ids: dict[str, int | None] = {}
    for name in ("bos", "eos", "unknown", "padding"):
        key = f"tokenizer.ggml.{name}_token_id"
        if key not in gguf.metadata:
            ids[name] = None
            continue
        token_id = metadata_int(gguf, key)
        if not 0 <= token_id < count:
            raise GGUFError(f"{gguf.path}: metadata {key!r} = {token_id} is not a token id (0..{count - 1})")
        ids[name] = token_id
    return ids


# tokenizers' serialised Tokenizer with a BPE model and nothing else; _bpe_json fills in vocab and merges.
_BPE_JSON_HEAD = ('{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,'
                  '"pre_tokenizer":null,"post_processor":null,"decoder":null,"model":{"type":"BPE","dropout":null,'
                  '"unk_token":null,"continuing_subword_prefix":"","end_of_word_suffix":"","fuse_unk":false,'
                  '"byte_fallback":false,"ignore_merges":false,"vocab":{')


def _bpe_json(tokens: Iterable[str], merges: Iterable[tuple[str, str]]) -> str:
    """The byte-level BPE model as tokenizers' JSON, written a token at a time: as a Python dict and list
    the ~100k strings of a vocabulary and its merges would be alive together, and the objects made beside
    them would keep part of the interpreter's heap for good (reader.StringArray says more). A token listed
    twice keeps its last id, as a dict would."""
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    text = bytearray(_BPE_JSON_HEAD.encode("ascii"))
    for index, token in enumerate(tokens):
        # A token outside GPT-2's byte alphabet (a raw space, a control token with odd characters) is
        # spelled byte by byte, as transformers does, so that the vocabulary and the merges agree.
        if not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        text += f'{"," if index else ""}{json.dumps(token)}:{index}'.encode("ascii")
    text += b'},"merges":['
    for index, (left, right) in enumerate(merges):
        text += f'{"," if index else ""}[{json.dumps(left)},{json.dumps(right)}]'.encode("ascii")
    text += b"]}}"
    return text.decode("ascii")


def _byte_level_bpe(gguf: GGUFFile) -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers

    tokens = _string_list(gguf, "tokenizer.ggml.tokens")
    types = _token_types(gguf, len(tokens))
    try:
        backend = Tokenizer.from_str(_bpe_json(tokens, _merges(gguf)))
    except Exception as exc:  # the Rust side raises a plain Exception (e.g. a merge of unknown tokens)
        raise GGUFError(f"{gguf.path}: the byte-level BPE vocabulary is inconsistent ({exc})") from None
    split = PRE_TOKENIZER_SPLITS.get(metadata_str(gguf, "tokenizer.ggml.pre", "default"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    # Control tokens spelled outside the byte alphabet are llama.cpp mislabels; adding them would grow
    # the vocabulary past the model's embedding, so they are left out (transformers does the same).
    alphabet = set(_byte_alphabet().values())
    control = [AddedToken(token, normalized=False, special=True)
               for token, kind in zip(tokens, types) if kind == _CONTROL and set(token) <= alphabet]
    if control:
        backend.add_special_tokens(control)
    known = backend.get_vocab()
    user_defined = [AddedToken(token, normalized=False, special=False)
                    for token, kind in zip(tokens, types) if kind == _USER_DEFINED and token in known]
    if user_defined:
        backend.add_tokens(user_defined)
    return backend


def _sentencepiece(gguf: GGUFFile, tokens: Sequence[str], types: np.ndarray) -> Any:
    from edgetrain.models.gguf.spm_tokenizer import sentencepiece_bpe

    return sentencepiece_bpe(gguf, tokens, types)


# tokenizer.ggml.model -> the builder of its backend (gguf, tokens, token types).
_TOKENIZER_BUILDERS = {"gpt2": lambda gguf, tokens, types: _byte_level_bpe(gguf), "llama": _sentencepiece}


def gguf_tokenizer(gguf: GGUFFile) -> GGUFTokenizer:
    kind = metadata_str(gguf, "tokenizer.ggml.model")
    if kind not in SUPPORTED_TOKENIZER_MODELS:
        raise GGUFError(f"{gguf.path}: tokenizer.ggml.model {kind!r} is not supported; edgetrain builds "
                        "byte-level BPE ('gpt2') and SentencePiece ('llama') tokenizers from GGUF")
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise EdgetrainError(f"reading the tokenizer of {gguf.path} needs the 'tokenizers' package: "
                             "pip install tokenizers") from None
    tokens = _string_list(gguf, "tokenizer.ggml.tokens")
    template = gguf.metadata.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise GGUFError(f"{gguf.path}: metadata 'tokenizer.chat_template' must be a string")
    backend = _TOKENIZER_BUILDERS[kind](gguf, tokens, _token_types(gguf, len(tokens)))
    return GGUFTokenizer(gguf.path, backend, _special_ids(gguf, len(tokens)), template)


def load_gguf_tokenizer(path: str | Path) -> GGUFTokenizer:
    """The tokenizer stored in a GGUF file's metadata (the file's tensors are not read)."""
    return gguf_tokenizer(read_gguf(path))
