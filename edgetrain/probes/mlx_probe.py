"""MLX: what MLX's allocator holds (Metal buffers on Apple silicon, host memory with mlx[cpu]).

(Not named mlx.py: a module of that name would shadow the mlx package for code beside it.)
Uses mx.get_peak_memory / mx.reset_peak_memory / mx.get_active_memory; older MLX releases had them
only as mx.metal.*; newer releases keep those as deprecated aliases. Active memory excludes MLX's
buffer cache (mx.get_cache_memory), as torch's "allocated" excludes its cache.
"""
from __future__ import annotations

from typing import Any, Callable

from edgetrain.probes.base import PROBES, require_available

_FUNCTIONS = ("get_peak_memory", "reset_peak_memory", "get_active_memory")


def _mlx_memory_functions() -> tuple[dict[str, Callable[..., Any]] | None, str]:
    """The three functions from mx (new names) or mx.metal (old names), or None and why not."""
    try:
        import mlx.core as mx
    except ImportError as exc:
        return None, f"mlx is not importable ({exc}); install edgetrain[mlx]"
    for namespace, where in ((mx, "mlx.core"), (getattr(mx, "metal", None), "mlx.core.metal")):
        if namespace is not None and all(hasattr(namespace, f) for f in _FUNCTIONS):
            return {f: getattr(namespace, f) for f in _FUNCTIONS}, where
    return None, "this mlx has no get_peak_memory/reset_peak_memory/get_active_memory (in mx or mx.metal)"


@PROBES.register("mlx")
class MlxProbe:
    """Peak and active bytes of MLX's allocator (process-wide; MLX has one allocator)."""

    name = "mlx"

    def __init__(self) -> None:
        self._functions, self._where_or_why = _mlx_memory_functions()
        # mx.reset_peak_memory() sets the peak to 0, not to the active memory; the allocator
        # raises it again only on the next allocation. Whatever was live at the reset is part of
        # the new window's peak, so it is remembered here.
        self._active_at_reset = 0

    def available(self) -> tuple[bool, str]:
        if self._functions is None:
            return False, self._where_or_why
        return True, ""

    def reset_peak(self) -> None:
        require_available(self)
        self._functions["reset_peak_memory"]()
        self._active_at_reset = self._functions["get_active_memory"]()

    def peak_bytes(self) -> int:
        require_available(self)
        return max(self._functions["get_peak_memory"](), self._active_at_reset)

    def current_bytes(self) -> int:
        require_available(self)
        return self._functions["get_active_memory"]()
