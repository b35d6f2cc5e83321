"""MeSP's block programs compiled with torch.compile: one forward and one backward program for every block.

Every decoder block has the same shapes, and a block's weights are inputs of `block_forward` and
`block_backward`, not constants. So the compiler traces each program once and every block replays it. What
that buys differs by device:

- CUDA (mode "reduce-overhead"): the programs are replayed as CUDA graphs (torch.compile's CUDA graph trees),
  and inductor fuses the elementwise kernels between the matrix products. Eager mesp on an H200 waited on
  about 17,000 kernel launches a step (docs/devices.md); a Jetson's CPU issues launches far more slowly.
- CPU (mode "default"): inductor fuses the elementwise kernels into C++ it compiles on the spot.

Off by default (`compile_blocks=False`). Turning it on costs torch._dynamo's import (about 70 MiB resident),
a compile on the first step (about 50 s for a two-block test model on 2 cores), a C++ compiler on a CPU and
triton on a GPU. The results are not bit-equal to eager: the compiler fuses and reorders floating-point work;
`tests/methods/test_mesp_compiled.py` holds them within 1e-5 of eager and of `bp`. What it gives on a GPU is
measured by `tools/gpu_check.sh` when one is lent (none was, when this was written: see docs/devices.md).

A program that cannot be compiled here (no compiler, a backend error) falls back to eager for the rest of the
process, once, with a warning naming the error.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import torch

from edgetrain.methods.mesp.block import block_backward, block_forward

log = logging.getLogger(__name__)

# torch.compile mode per device type; a device type not named here runs eager.
COMPILE_MODES = {"cuda": "reduce-overhead", "cpu": "default"}


@functools.cache
def compiled_programs(mode: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(block_forward, block_backward) compiled in `mode`, made once per process and shared by every learner
    (the compiler's cache is per function object, and a failed compile falls back once, not every step)."""
    return (_Program(torch.compile(block_forward, mode=mode, dynamic=False), block_forward),
            _Program(torch.compile(block_backward, mode=mode, dynamic=False), block_backward))


class _Program:
    """A compiled program that turns into its eager function for good when compiling fails."""

    def __init__(self, compiled: Callable[..., Any], eager: Callable[..., Any]) -> None:
        self.compiled, self.eager = compiled, eager

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled is None:
            return self.eager(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 -- only the compiler's own failures fall back (re-raised otherwise)
            if not _compiler_failure(exc):
                raise
            log.warning("mesp compile_blocks: %s could not be compiled here (%s: %s); running it eagerly",
                        self.eager.__name__, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            self.compiled = None
            # The programs are pure functions of their inputs: running the call again eagerly is exact.
            return self.eager(*args, **kwargs)


def _compiler_failure(exc: Exception) -> bool:
    """Whether `exc` is the compiler failing (no C++ compiler, no triton, a backend error), not the model."""
    module = type(exc).__module__ or ""
    return module.startswith(("torch._dynamo", "torch._inductor")) or "CompilerFailed" in type(exc).__name__


def block_programs(device: torch.device, compile_blocks: bool) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The (forward, backward) block programs a step on `device` runs: compiled when asked and the device has a
    compiled path, else eager."""
    if not compile_blocks:
        return block_forward, block_backward
    mode = COMPILE_MODES.get(device.type)
    if mode is None:
        log.warning("mesp compile_blocks: no compiled path on %s; running eagerly", device.type)
        return block_forward, block_backward
    return compiled_programs(mode)
