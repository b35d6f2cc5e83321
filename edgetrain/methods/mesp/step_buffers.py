"""Buffers a MeSP step hands out again once their tensors are gone, so its temporaries fault in once.

Every block runs the same shapes, so a step allocates the same few dozen temporaries sixty times (thirty
blocks, forward and backward). On a CPU each temporary of 64 KiB or more is a fresh mapping from the kernel
whenever edgetrain's memory probe has pinned glibc's mmap threshold (edgetrain/probes/glibc.py): its pages are
faulted in and zeroed on first touch and unmapped on free. On SmolLM2-135M (seq 128 x batch 2) that was
1.6 GB of fresh pages a step, about 400,000 page faults and 0.6 s of a 2.1 s step (docs/benchmarks.md, "A step's
buffers"; `mesp:fresh` in tools/bench_mesp.py is the step without the pool). With the pool the step faults in
only the buffers it keeps: about 10,000 pages.

A buffer is handed out again only when no tensor uses its memory any more: its storage's reference count is
back to what it was when only the pool held it. So a pooled tensor has exactly the lifetime of a fresh one
(`del`, reassignment and going out of scope free it), nothing can be overwritten while it is still read, and
a pooled tensor that escapes (a block's output kept as the next block's input) simply stays taken. The pool
is dropped when the step ends, which hands its memory back. What it can add to the peak is the buffers free at
that moment, or holding a smaller tensor than they were made for. So free buffers go back to the allocator
where shapes change: at each phase of the step (forward, loss, backward), after a block backward's MLP, and on
a miss, the free buffers too small for it. Without the last two, Qwen3-0.6B's step (queries twice the hidden
size, head norms: more shapes) peaked at 60.0 MiB against the plain allocator's 51.4; with them 52.7, for
about 12,000 page faults a block in place of 5,000 (66,000 unpooled).
`tests/methods/test_mesp_step_buffers.py` bounds the peak on both shapes.

The release after a block's MLP keeps, though, as many free buffers as the step has made room for: each block
input the backward lets go of (held since the forward, so part of whatever peak the step reaches) makes room
for that many bytes (`make_room`), and the largest free buffers that fit in it stay for the next block's MLP.
The step then never holds more than it did with the input still stored, and after a few blocks the MLP's
buffers are no longer mapped afresh each block. On SmolLM2-135M Q4_K_M (seq 128 x batch 2, this 2-core
machine, 2026-12-08) that took a step's page faults from 104,000 to 47,000 (`edgetrain profile --json`'s
`minor_faults_per_step`), the peak unchanged (26.5 MiB of tensors), and the step 6% faster (1.198 s against
1.278 in six alternating rounds of an in-process harness that switched the rule, not kept in tools/).

Off (the plain allocator for every tensor): outside `step_buffers()`, where the reference count cannot be read
(a torch without `_storage_Use_Count`), on accelerators (their caching allocators already reuse memory), and
with the `reuse_buffers=False` method option. The numbers are the same either way: only where a result is
written changes, never how it is computed (tested bit for bit).
"""
from __future__ import annotations

import bisect
import math
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Sequence

import torch

from edgetrain.probes.glibc import STABLE_MMAP_THRESHOLD_BYTES

_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)

# Temporaries below this size come from the heap, where freed memory is reused anyway (glibc maps only blocks
# from the pinned mmap threshold up).
MIN_POOLED_BYTES = STABLE_MMAP_THRESHOLD_BYTES


def _use_count(buffer: torch.Tensor) -> int:
    return _storage_use_count(buffer.untyped_storage()._cdata)


class StepBuffers:
    """Reusable buffers of one step, per (dtype, device), each handed out whole or as a prefix."""

    def __init__(self, min_bytes: int | None = None) -> None:
        self.min_bytes = MIN_POOLED_BYTES if min_bytes is None else min_bytes
        # (dtype, device) -> [(element count, buffer, its storage's use count while only the pool holds it)],
        # smallest first
        self._buffers: dict[tuple, list[tuple[int, torch.Tensor, int]]] = {}
        self.allocated = 0  # buffers made (for tests and the benchmark)
        self.reused = 0
        # Bytes the step has given back since its peak could have been reached: free buffers up to this much may
        # be kept where shapes change (release_free(within_room=True)) without the step ever holding more.
        self.room = 0

    def empty(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised contiguous tensor: the smallest free buffer that holds it, else a new buffer.

        Best fit over all sizes, not one list per size: a step's phases need different shapes (the loss's
        [tokens, vocab tile], the MLP's [tokens, intermediate], attention's score chunks), and a buffer left
        free by one phase serving the next is what keeps the pool near the step's own peak."""
        numel = math.prod(shape)
        if numel * dtype.itemsize < self.min_bytes:
            return torch.empty(shape, dtype=dtype, device=device)
        held = self._buffers.setdefault((dtype, device), [])
        for size, buffer, free_count in held[bisect.bisect_left(held, numel, key=lambda entry: entry[0]):]:
            if _use_count(buffer) == free_count:
                self.reused += 1
                return (buffer if size == numel else buffer[:numel]).view(shape)
        # A miss: the free buffers too small for it would sit idle beside the new one (a phase's shapes grew),
        # adding to the step's peak, so they go back to the allocator first.
        held[:] = [entry for entry in held if entry[0] >= numel or _use_count(entry[1]) != entry[2]]
        buffer = torch.empty(numel, dtype=dtype, device=device)
        bisect.insort(held, (numel, buffer, _use_count(buffer)), key=lambda entry: entry[0])
        self.allocated += 1
        return buffer.view(shape)

    def release_free(self, within_room: bool = False) -> None:
        """Drop the buffers no tensor uses (their memory goes back to the allocator); within_room: all but the
        largest free ones that fit in `room` together."""
        budget = self.room if within_room else 0
        free = sorted(((size * buffer.element_size(), id(buffer)) for held in self._buffers.values()
                       for size, buffer, free_count in held if _use_count(buffer) == free_count), reverse=True)
        kept = set()
        for nbytes, buffer_id in free:
            if nbytes <= budget:
                kept.add(buffer_id)
                budget -= nbytes
        for key, held in self._buffers.items():
            self._buffers[key] = [entry for entry in held
                                  if _use_count(entry[1]) != entry[2] or id(entry[1]) in kept]

    def make_room(self, nbytes: int) -> None:
        """The step let go of `nbytes` it held since its peak could have been reached (a stored block input,
        once its block's backward is done): that much may be kept free later on without a higher peak."""
        self.room += nbytes

    def held_bytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for held in self._buffers.values() for _, buffer, _ in held)


_ACTIVE: ContextVar[StepBuffers | None] = ContextVar("edgetrain_mesp_step_buffers", default=None)


def available(device: torch.device) -> bool:
    """Whether a step on `device` reuses its buffers: a CPU, and a torch that reports storage use counts."""
    return device.type == "cpu" and _storage_use_count is not None


@contextmanager
def step_buffers(enabled: bool = True) -> Iterator[StepBuffers | None]:
    """Within it, `empty()` hands out reused buffers (None is yielded when disabled); they go when it ends."""
    buffers = StepBuffers() if enabled and _storage_use_count is not None else None
    token = _ACTIVE.set(buffers)
    try:
        yield buffers
    finally:
        _ACTIVE.reset(token)


@contextmanager
def fresh_allocations() -> Iterator[None]:
    """Within it, `empty()` allocates as torch does: for tensors kept past the step's working set."""
    token = _ACTIVE.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> StepBuffers | None:
    # Compiled block programs (edgetrain/methods/mesp/compiled.py) allocate through the compiler, which plans
    # their buffers itself; the pool is not consulted while tracing (nor could it be: ContextVar is opaque to it).
    if torch.compiler.is_compiling():
        return None
    return _ACTIVE.get()


def release_free(within_room: bool = False) -> None:
    """Drop the active pool's free buffers: at a phase boundary, where the shapes the step needs change.
    within_room: keep the largest free ones that fit in the room the step has made (make_room)."""
    buffers = active()
    if buffers is not None:
        buffers.release_free(within_room)


def make_room(tensor: torch.Tensor) -> None:
    """The step is done with `tensor`, which it held since before its peak (a stored block input): the active
    pool may keep that many bytes of free buffers from now on."""
    buffers = active()
    if buffers is not None:
        buffers.make_room(tensor.numel() * tensor.element_size())


def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """A pooled buffer for `shape`, or None when no pool is active (the caller then runs its plain form, so
    that a traced program, edgetrain/export/mesp_graph.py, keeps its functional graph)."""
    buffers = active()
    return None if buffers is None else buffers.empty(shape, dtype, device)


def _dense_order(tensor: torch.Tensor) -> list[int] | None:
    """The dimensions from outermost to innermost in memory, when the tensor covers its memory exactly
    (a permutation of a contiguous tensor); else None."""
    order = sorted(range(tensor.dim()), key=lambda dim: -tensor.stride(dim))
    expected = 1
    for dim in reversed(order):
        if tensor.shape[dim] != 1 and tensor.stride(dim) != expected:
            return None
        expected *= tensor.shape[dim]
    return order


def empty_like(tensor: torch.Tensor) -> torch.Tensor | None:
    """A pooled buffer shaped like `tensor` and laid out as it is (as torch.empty_like keeps a dense
    tensor's strides), or None when no pool is active."""
    buffers = active()
    if buffers is None:
        return None
    order = None if tensor.is_contiguous() else _dense_order(tensor)
    if order is None:
        return buffers.empty(tensor.shape, tensor.dtype, tensor.device)
    buffer = buffers.empty([tensor.shape[dim] for dim in order], tensor.dtype, tensor.device)
    return buffer.permute([order.index(dim) for dim in range(tensor.dim())])
