"""Tensor accounting: the peak bytes of live tensor storages during a region, on any torch device,
deterministically -- and which block (or labelled region) was running when the peak was reached.

How it counts. A TorchDispatchMode sees every aten op run inside it (forward, and backward when
.backward() is called inside the `with`: the autograd engine carries the mode to its threads).
Each output's *untyped storage* that the accountant has not seen before, and that is not one of
the op's inputs' storages (views, in-place and out= ops allocate nothing), is charged its nbytes;
a weakref on the storage object subtracts it when the storage is freed. Storages are keyed by
object identity, never by data_ptr, whose addresses the allocator reuses. torch keeps one Python
object per live storage (PyObject preservation), so the weakref fires exactly when the memory is
released, wherever the last reference was (autograd's saved tensors included).

What it cannot see: tensors created before the region unless register()ed (the model's
parameters, buffers and existing grads are registered for you, and form the baseline); memory a
kernel allocates internally below the dispatcher (matmul/conv workspaces, cuBLAS/oneDNN scratch);
allocator slack. On CUDA each storage is charged the caching allocator's 512-byte-rounded size, as
torch.cuda.memory_allocated counts it.

File-backed storages. A storage that is a private (copy-on-write) mapping of a file, such as weights
spilled to disk and mapped back (SegProp's spill_waiting), is not charged once `mark_file_backed`
has named it: the OS charges such a mapping only for the pages that are read or written, and a step
that never touches those weights holds none of them. The mark lives as long as the storage object.

Labels. Given a model with the block view (embed, blocks, head), forward pre/post hooks label the
region "blocks.3 forward" etc.; a hook on each block's output gradient switches the label to
"blocks.3 backward" when autograd reaches that block (until the backward pass ends); forwards
recomputed inside backward (activation checkpointing) are labelled "blocks.3 recompute". Method
code can label its own phases with `with accountant.region("optimizer step"):`; the innermost
label wins.
"""
from __future__ import annotations

import math
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from edgetrain.probes.base import PROBES

NO_LABEL = "(unlabelled)"
# c10/cuda/CUDACachingAllocator.cpp kMinBlockSize: every block is a multiple of 512 bytes.
CUDA_BLOCK_BYTES = 512


def charged_bytes(nbytes: int, device: torch.device) -> int:
    """What the device's allocator charges for a storage of `nbytes`."""
    if device.type == "cuda" and nbytes:
        return math.ceil(nbytes / CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
    return nbytes


def tensor_storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The untyped storages behind a tensor (several for a wrapper subclass; none for a sparse one)."""
    pending, found = [t], []
    while pending:
        obj = pending.pop()
        if is_traceable_wrapper_subclass(obj):
            names, _ = obj.__tensor_flatten__()
            pending.extend(v for v in (getattr(obj, n) for n in names) if isinstance(v, torch.Tensor))
            continue
        try:
            found.append(obj.untyped_storage())
        except (RuntimeError, NotImplementedError):  # sparse / nested layouts have no single storage
            pass
    return found


# Storages that are private file mappings, resident only where touched (mark_file_backed); weak, so a
# storage that is freed, or replaced by an in-memory copy, drops out by itself.
_FILE_BACKED = WeakIdKeyDictionary()


def mark_file_backed(tensor: torch.Tensor) -> None:
    """Tell every TensorAccountant that `tensor`'s storages map a file and are not resident until read."""
    for storage in tensor_storages(tensor):
        _FILE_BACKED[storage] = True


def is_file_backed(tensor: torch.Tensor) -> bool:
    """Whether all of `tensor`'s storages were marked by mark_file_backed (and still live)."""
    storages = tensor_storages(tensor)
    return bool(storages) and all(storage in _FILE_BACKED for storage in storages)


@dataclass
class _Live:
    charged: int
    ref: weakref.ref


@dataclass(frozen=True)
class TensorMemoryReport:
    baseline_bytes: int                 # live registered storages when the window began
    peak_bytes: int                     # highest live total in the window (baseline included)
    peak_label: str                     # label active when that peak was reached
    peak_bytes_by_label: dict[str, int] = field(default_factory=dict)  # highest live total per label

    @property
    def peak_above_baseline_bytes(self) -> int:
        return self.peak_bytes - self.baseline_bytes

    def peak_above_baseline_by_label(self) -> dict[str, int]:
        return {label: peak - self.baseline_bytes for label, peak in self.peak_bytes_by_label.items()}


@PROBES.register("tensors")
class TensorAccountant(TorchDispatchMode):
    """Counts live tensor storages inside `with accountant:`; also a MemoryProbe named "tensors".

    model:  registered at entry (parameters, buffers, grads) and, if it has the block view,
            hooked for per-block labels.
    device: count only storages on this device ("cuda" matches any CUDA index); None counts
            every device together (right for unified-memory devices such as a Jetson).
    """

    name = "tensors"

    def __init__(self, model: nn.Module | None = None, *, device: str | torch.device | None = None) -> None:
        super().__init__()
        self.model = model
        self.device = torch.device(device) if device is not None else None
        self._live: dict[int, _Live] = {}
        self._lock = threading.RLock()  # weakref callbacks can fire mid-update on this or an autograd thread
        self._current = 0
        self._baseline = 0
        self._peak = 0
        self._peak_label = NO_LABEL
        self._peak_by_label: dict[str, int] = {}
        # (label, kind) frames, innermost last; kind is "region", "forward" or "backward".
        self._frames: list[tuple[str, str]] = []
        self._hook_handles: list[Any] = []
        # Block outputs that already carry our gradient hook: a block that returns its input
        # unchanged must not relabel the backward of the block that produced it.
        self._hooked_outputs = WeakIdKeyDictionary()
        self._depth = 0

    # -- the probe protocol -----------------------------------------------------------------

    def available(self) -> tuple[bool, str]:
        return True, ""

    def reset_peak(self) -> None:
        with self._lock:
            self._baseline = self._current
            self._peak = self._current
            self._peak_label = self.label
            self._peak_by_label = {}
        self._note_peak()

    def peak_bytes(self) -> int:
        return self._peak

    def current_bytes(self) -> int:
        return self._current

    def report(self) -> TensorMemoryReport:
        with self._lock:
            return TensorMemoryReport(self._baseline, self._peak, self._peak_label, dict(self._peak_by_label))

    # -- entering and leaving ---------------------------------------------------------------

    def __enter__(self) -> "TensorAccountant":
        if self._depth == 0:
            if self.model is not None:
                self.register(self.model)
                self._install_block_hooks(self.model)
            self.reset_peak()
            super().__enter__()
        self._depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            for handle in self._hook_handles:
                handle.remove()
            self._hook_handles = []
            super().__exit__(*exc)

    def register(self, *objects: nn.Module | torch.optim.Optimizer | torch.Tensor | None) -> None:
        """Count storages created outside the region: modules (parameters, buffers, grads),
        optimizers (their state) and tensors (an input batch, say). They existed before the
        region, so they join the baseline too."""
        added = 0
        for obj in objects:
            if obj is None:
                continue
            if isinstance(obj, nn.Module):
                tensors = [*obj.parameters(), *obj.buffers()]
                tensors += [p.grad for p in obj.parameters() if p.grad is not None]
            elif isinstance(obj, torch.optim.Optimizer):
                tensors, _ = tree_flatten(list(obj.state.values()))
            elif isinstance(obj, torch.Tensor):
                tensors = [obj]
            else:
                raise TypeError(f"cannot register a {type(obj).__name__}; pass modules, optimizers or tensors")
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    for storage in tensor_storages(t):
                        added += self._track(storage)
        with self._lock:
            self._baseline += added
        self._note_peak()

    # -- counting ---------------------------------------------------------------------------

    def _counts(self, storage: torch.UntypedStorage) -> bool:
        device = storage.device
        if device.type == "meta":  # fake and meta tensors hold no memory
            return False
        if storage in _FILE_BACKED:
            return False
        if self.device is None:
            return True
        return device.type == self.device.type and (self.device.index is None or device.index == self.device.index)

    def _track(self, storage: torch.UntypedStorage) -> int:
        """Charge a storage not seen before, or re-charge one whose size changed (resize_);
        returns the change in live bytes."""
        if not self._counts(storage):
            return 0
        key = id(storage)
        charged = charged_bytes(storage.nbytes(), storage.device)
        with self._lock:
            entry = self._live.get(key)
            if entry is not None and entry.ref() is storage:
                change = charged - entry.charged
                entry.charged = charged
            else:
                self._live[key] = _Live(charged, weakref.ref(storage, partial(self._on_free, key)))
                change = charged
            self._current += change
            return change

    def _on_free(self, key: int, ref: weakref.ref) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is not None and entry.ref is ref:
                del self._live[key]
                self._current -= entry.charged

    def _is_known(self, storage: torch.UntypedStorage) -> bool:
        entry = self._live.get(id(storage))
        return entry is not None and entry.ref() is storage

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        input_storages: list[torch.UntypedStorage] | None = None
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            for storage in tensor_storages(t):
                if self._is_known(storage):
                    self._track(storage)  # cheap: only re-charges when the size changed
                    continue
                if input_storages is None:  # computed only when an output storage is new to us
                    input_storages = [s for x in tree_flatten((args, kwargs))[0]
                                      if isinstance(x, torch.Tensor) for s in tensor_storages(x)]
                # An output on one of the inputs' storages (view, in-place, out=) allocated nothing;
                # if that input came from outside the region it stays uncounted.
                if not any(storage is s for s in input_storages):
                    self._track(storage)
        self._note_peak()
        return out

    def _note_peak(self) -> None:
        with self._lock:
            label = self.label
            if self._current > self._peak:
                self._peak = self._current
                self._peak_label = label
            if self._current > self._peak_by_label.get(label, -1):
                self._peak_by_label[label] = self._current

    # -- labels -----------------------------------------------------------------------------

    @property
    def label(self) -> str:
        frames = self._frames
        return frames[-1][0] if frames else NO_LABEL

    @contextmanager
    def region(self, label: str) -> Iterator[None]:
        """Label what runs inside (e.g. "block 3 backward", "optimizer step")."""
        depth = len(self._frames)
        self._frames.append((label, "region"))
        self._note_peak()
        try:
            yield
        finally:
            del self._frames[depth:]  # also drops block frames a failed forward left behind
            self._note_peak()

    def _install_block_hooks(self, model: nn.Module) -> None:
        blocks = getattr(model, "blocks", None)
        if not isinstance(blocks, nn.ModuleList):
            return  # no block view: only explicit regions label the run
        named = [("embed", getattr(model, "embed", None))]
        named += [(f"blocks.{i}", block) for i, block in enumerate(blocks)]
        named += [("head", getattr(model, "head", None))]
        for name, module in named:
            if isinstance(module, nn.Module):
                self._hook_handles.append(module.register_forward_pre_hook(partial(self._forward_begins, name)))
                self._hook_handles.append(
                    module.register_forward_hook(partial(self._forward_ends, name), always_call=True))

    def _forward_begins(self, name: str, module: nn.Module, args: Any) -> None:
        inside_backward = bool(self._frames) and self._frames[-1][1] == "backward"
        self._frames.append((f"{name} recompute" if inside_backward else f"{name} forward", "forward"))
        self._note_peak()

    def _forward_ends(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        for i in range(len(self._frames) - 1, -1, -1):
            if self._frames[i][1] == "forward" and self._frames[i][0].startswith(f"{name} "):
                del self._frames[i:]
                break
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad and t not in self._hooked_outputs:
                    self._hooked_outputs[t] = True
                    t.register_hook(partial(self._backward_reaches, f"{name} backward"))

    def _backward_reaches(self, label: str, grad: torch.Tensor) -> None:
        # Fires when the gradient of this block's output is complete, i.e. just before autograd
        # runs the block's own backward ops. Blocks are sequential, so the newest one wins.
        if self._depth == 0:
            return
        if self._frames and self._frames[-1][1] == "backward":
            self._frames[-1] = (label, "backward")
        else:
            self._frames.append((label, "backward"))
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        self._note_peak()

    def _backward_done(self) -> None:
        for i in range(len(self._frames) - 1, -1, -1):
            if self._frames[i][1] == "backward":
                del self._frames[i:]
                break
