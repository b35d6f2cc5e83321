"""Streams by name: `make_stream("digits", batch_size=32)`; the CLI's `--data` looks names up here."""
from __future__ import annotations

from typing import Any, Callable

from edgetrain.data.digits import digits_stream
from edgetrain.data.fashion_mnist import fashion_mnist_stream
from edgetrain.data.indexed import IndexedStream
from edgetrain.data.text import text_stream
from edgetrain.registry import Registry

STREAMS: Registry[Callable[..., IndexedStream]] = Registry("stream")
STREAMS.add("text", text_stream)
STREAMS.add("digits", digits_stream)
STREAMS.add("fashion-mnist", fashion_mnist_stream)


def make_stream(name: str, **options: Any) -> IndexedStream:
    """The stream registered as `name`, built with `options` (e.g. batch_size, seed, start_index);
    an unknown name raises an error listing the known ones."""
    return STREAMS.get(name)(**options)
