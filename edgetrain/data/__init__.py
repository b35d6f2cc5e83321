"""Streams: iterators of batches arriving one at a time, resumable from any batch index."""
from __future__ import annotations

from edgetrain.data.arrays import ArrayStream
from edgetrain.data.batch import Batch
from edgetrain.data.binary import BinaryInputError
from edgetrain.data.chat_template import ChatTemplate, ChatTemplateError
from edgetrain.data.digits import digits_stream, load_digits_split
from edgetrain.data.fashion_mnist import (FASHION_MNIST_CLASSES, FASHION_MNIST_DIR, fashion_mnist_stream,
                                          load_fashion_mnist, parse_idx, read_idx)
from edgetrain.data.indexed import IndexedStream
from edgetrain.data.jsonl import JsonlError
from edgetrain.data.jsonl_stream import JsonlStream
from edgetrain.data.streams import STREAMS, make_stream
from edgetrain.data.text import (TEXT_CORPORA, TextStream, default_text_corpus, find_text_files, fortunes_corpus,
                                 read_text_files, text_stream)
from edgetrain.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from edgetrain.data.validate import BadBatchError, validate_batch

__all__ = ["ArrayStream", "BadBatchError", "Batch", "BinaryInputError", "ByteTokenizer", "ChatTemplate", "ChatTemplateError",
           "FASHION_MNIST_CLASSES", "FASHION_MNIST_DIR", "HFTokenizer", "IndexedStream", "JsonlError", "JsonlStream",
           "STREAMS", "TEXT_CORPORA", "TextStream", "Tokenizer",
           "default_text_corpus", "digits_stream", "fashion_mnist_stream", "find_text_files", "fortunes_corpus",
           "load_digits_split", "load_fashion_mnist", "load_tokenizer", "make_stream", "parse_idx", "read_idx",
           "read_text_files", "text_stream", "validate_batch"]
