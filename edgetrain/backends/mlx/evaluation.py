"""MLX's mx.eval at MeSP's chunk and phase boundaries, or nothing while a MeSP piece is traced for export.

The boundaries are what bound MeSP's live set in a Python step (an unevaluated array keeps its whole graph
alive). mx.export_function refuses an eval while it traces, and an exported piece is one graph that MLX
evaluates as a whole anyway, so edgetrain/export/mlx_program.py traces the same code under `deferred()`.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import mlx.core as mx

_STATE = threading.local()


def evaluate(*arrays: object) -> None:
    """mx.eval(*arrays), unless this thread is tracing under deferred()."""
    if not getattr(_STATE, "deferred", False):
        mx.eval(*arrays)


@contextmanager
def deferred() -> Iterator[None]:
    previous = getattr(_STATE, "deferred", False)
    _STATE.deferred = True
    try:
        yield
    finally:
        _STATE.deferred = previous
