"""A GGUF's SentencePiece vocabulary (`tokenizer.ggml.model` "llama": Gemma, Llama 2, TinyLlama) as a
`tokenizers` Tokenizer that splits text as llama.cpp's SPM tokenizer does.

llama.cpp's SPM tokenizer (llama-vocab.cpp, llm_tokenizer_spm) writes spaces as "▁", prefixes a space to each
piece of text that starts the input or follows a special token (when `tokenizer.ggml.add_space_prefix`, true by
default), then merges adjacent symbols into the vocabulary's tokens, always the pair whose merged token scores
highest first, and spells what no token covers byte by byte (`<0x0A>` tokens). That is BPE whose merges are
every pair of tokens that makes a token, ranked by the made token's score: what is built here (transformers
builds the same from a GGUF). Control and user-defined tokens are matched whole, before any merge.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from edgetrain.models.gguf.reader import GGUFError, GGUFFile

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp token types
_SPACE = "\u2581"


def _scores(gguf: GGUFFile, count: int) -> np.ndarray:
    value = gguf.metadata.get("tokenizer.ggml.scores")
    if value is None:
        raise GGUFError(f"{gguf.path}: a SentencePiece vocabulary needs 'tokenizer.ggml.scores' (one per token)")
    if not isinstance(value, np.ndarray) or value.dtype.kind != "f" or len(value) != count \
            or not np.isfinite(value).all():
        raise GGUFError(f"{gguf.path}: metadata 'tokenizer.ggml.scores' must be an array of {count} finite numbers "
                        "(one per token)")
    return value


def score_ranked_merges(tokens: Sequence[str], scores: np.ndarray, types: np.ndarray) -> list[tuple[str, str]]:
    """Every (left, right) pair of tokens whose concatenation is a normal token, best-scoring made token first
    (ties: the made token's id, then the split point, so the order never depends on a set's)."""
    ids = {token: index for index, token in enumerate(tokens)}
    ranked = []
    for made, token in enumerate(tokens):
        if types[made] not in (_NORMAL, 0) or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-float(scores[made]), made, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def sentencepiece_bpe(gguf: GGUFFile, tokens: Sequence[str], types: np.ndarray) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers

    from edgetrain.models.gguf.config import metadata_int

    scores = _scores(gguf, len(tokens))
    unknown = metadata_int(gguf, "tokenizer.ggml.unknown_token_id", 0)
    if not 0 <= unknown < len(tokens):
        raise GGUFError(f"{gguf.path}: tokenizer.ggml.unknown_token_id = {unknown} is not a token id")
    add_space_prefix = gguf.metadata.get("tokenizer.ggml.add_space_prefix", True)
    if not isinstance(add_space_prefix, bool):
        raise GGUFError(f"{gguf.path}: metadata 'tokenizer.ggml.add_space_prefix' must be true or false")
    model = {"type": "BPE", "dropout": None, "unk_token": tokens[unknown], "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
             "vocab": {token: index for index, token in reversed(list(enumerate(tokens)))},
             "merges": [list(pair) for pair in score_ranked_merges(tokens, scores, types)]}
    try:
        backend = Tokenizer.from_str(json.dumps({"version": "1.0", "truncation": None, "padding": None,
                                                 "added_tokens": [], "normalizer": None, "pre_tokenizer": None,
                                                 "post_processor": None, "decoder": None, "model": model}))
    except Exception as exc:  # the Rust side raises a plain Exception
        raise GGUFError(f"{gguf.path}: the SentencePiece vocabulary is inconsistent ({exc})") from None
    # Normalizers run on each piece between special tokens: the prefix goes where llama.cpp puts it.
    steps = [normalizers.Prepend(_SPACE)] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPACE)])
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    backend.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *strip])
    control = [AddedToken(token, normalized=False, special=True)
               for token, kind in zip(tokens, types) if kind == _CONTROL]
    user_defined = [AddedToken(token, normalized=False, special=False)
                    for token, kind in zip(tokens, types) if kind == _USER_DEFINED]
    if control:
        backend.add_special_tokens(control)
    if user_defined:
        backend.add_tokens(user_defined)
    return backend
