"""Streams: iterators of batches arriving one at a time, resumable from any batch index."""
from __future__ import annotations

from typing import Any, Callable, Iterable

from edgetrain.data.arrays import ArrayStream
from edgetrain.data.batch import Batch
from edgetrain.data.digits import digits_stream, load_digits_split
from edgetrain.data.fashion_mnist import fashion_mnist_stream, load_fashion_mnist, parse_idx, read_idx
from edgetrain.data.text import TextStream, default_text_corpus, fortunes_corpus, text_stream
from edgetrain.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from edgetrain.data.validate import BadBatchError, validate_batch
from edgetrain.registry import Registry

STREAMS: Registry[Callable[..., Iterable[Batch]]] = Registry("stream")
STREAMS.add("text", text_stream)
STREAMS.add("digits", digits_stream)
STREAMS.add("fashion-mnist", fashion_mnist_stream)


def make_stream(name: str, **options: Any) -> Iterable[Batch]:
    return STREAMS.get(name)(**options)


__all__ = ["ArrayStream", "BadBatchError", "Batch", "ByteTokenizer", "HFTokenizer", "STREAMS", "TextStream",
           "default_text_corpus", "digits_stream", "fashion_mnist_stream", "fortunes_corpus", "load_digits_split",
           "load_fashion_mnist", "load_tokenizer", "make_stream", "parse_idx", "read_idx", "text_stream",
           "validate_batch"]
