"""spill_waiting: the weights of segments whose stage has not begun live in a file, not in memory.

While stage i trains, the units after its segment and before its global head (the *waiting* units) are
neither on the loss path nor trained: on ResNet-18's paper split, stage 0 holds 33 of the 46 MiB of
weights this way. Their parameters and buffers are written to one spill file (torch.save) and re-pointed
(`tensor.data = ...`) at a private, copy-on-write mapping of it (torch.load(mmap=True)). Every reader
(state_dict, Learner checkpoints, snapshots, evaluation, export) reads the same values through the
mapping; the OS makes a page resident only when it is read, and a step of stage i reads none of them.
A write through the mapping (a checkpoint load copies values in) stays in private memory and never
reaches the file. When a unit's stage begins its tensors are copied back into ordinary memory before
they train; `restore_all` (finish, close) brings every one back and deletes the file.

Exact by construction: the bytes saved are the bytes mapped, and nothing computes on a different copy.
Each application writes the *current* values of the waiting tensors (whatever a checkpoint load or a
manual edit put there) to a new file, so a re-applied stage never maps stale weights.

Writes are atomic: a temporary name, then a rename, and tensors are re-pointed only once the file is
complete and mapped; a failed write leaves every tensor as it was and names the file.
"""
from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from edgetrain.methods.segprop.plan import Stage
from edgetrain.methods.segprop.stage_parts import StageParts
from edgetrain.probes.tensors import mark_file_backed
from edgetrain.registry import EdgetrainError

_names = itertools.count()


def waiting_tensors(parts: StageParts, stage: Stage) -> list[torch.Tensor]:
    """Parameters and buffers of the units after `stage`'s segment and before its head units that no
    module on the stage's path, the committed prefix, the head or an adapter also holds (tied weights
    stay in memory)."""
    units = parts.view.units[stage.end:stage.tail_start]
    waiting_ids = {id(u) for u in units}
    others = [m for m in parts.all_modules() if id(m) not in waiting_ids]
    kept = {id(t) for m in others for t in [*m.parameters(), *m.buffers()]}
    found: dict[int, torch.Tensor] = {}
    for unit in units:
        for tensor in [*unit.parameters(), *unit.buffers()]:
            if id(tensor) not in kept and _spillable(tensor):
                found.setdefault(id(tensor), tensor)
    return list(found.values())


def _spillable(tensor: torch.Tensor) -> bool:
    # Only plain dense CPU tensors: a mapping of a file is CPU memory, and a subclass (a quantised
    # weight) may not survive torch.save / torch.load(mmap=True) as the same object type.
    return (tensor.device.type == "cpu" and tensor.layout == torch.strided
            and type(tensor) in (torch.Tensor, nn.Parameter) and tensor.numel() > 0)


def check_options(name: str, enabled: Any, directory: Any, device: torch.device) -> "WaitingSpill | None":
    """The spill for `spill_waiting` / `spill_waiting_dir`, or None when off; bad values are named errors."""
    if not isinstance(enabled, bool):
        raise EdgetrainError(f"{name}: spill_waiting must be true or false, got {enabled!r}")
    if not isinstance(directory, (str, os.PathLike)):
        raise EdgetrainError(f"{name}: spill_waiting_dir must be \"auto\" or a directory path, got {directory!r}")
    if not enabled:
        return None
    if device.type != "cpu":
        # Re-pointing at a file mapping would move the weights to the CPU, which no reader expects.
        raise EdgetrainError(f"{name}: spill_waiting maps weights from a file into CPU memory; the model is on "
                             f"{device}")
    if directory != "auto":
        path = Path(directory)
        if not path.is_dir():
            raise EdgetrainError(f"{name}: spill_waiting_dir {str(path)!r} is not an existing directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise EdgetrainError(f"{name}: spill_waiting_dir {str(path)!r} is not writable")
    return WaitingSpill(name, str(directory))


@dataclass
class WaitingSpill:
    """The spill file of the current stage's waiting tensors, and the tensors re-pointed at it."""
    name: str
    setting: str                                   # "auto" or an existing directory
    directory: Path | None = None
    file: Path | None = None
    spilled: dict[int, torch.Tensor] = field(default_factory=dict)   # id -> tensor mapped from `file`
    _cleanup: Any = None        # removes an "auto" directory if the trainer is dropped unclosed
    _file_cleanup: Any = None   # removes the current file if the trainer is dropped unclosed

    def apply(self, tensors: list[torch.Tensor]) -> None:
        """Map exactly `tensors` from a fresh spill file of their current values; tensors mapped before and
        not in `tensors` (their stage begins) come back into memory first."""
        wanted = {id(t) for t in tensors}
        for key in [k for k in self.spilled if k not in wanted]:
            _bring_back(self.spilled.pop(key))
        old = self.file
        if tensors:
            path = self._write(tensors)
            mapped = self._map(path)
            for index, tensor in enumerate(tensors):
                tensor.data = mapped[str(index)]
                mark_file_backed(tensor)
            self.file, self.spilled = path, {id(t): t for t in tensors}
        else:
            self.file = None
        if old is not None and old != self.file:
            _unlink(old)  # the tensors that still map it were re-pointed above
        self._watch(self.file)

    def restore_all(self) -> None:
        """Every spilled tensor back in ordinary memory; the spill file (and an "auto" directory) deleted."""
        for tensor in self.spilled.values():
            _bring_back(tensor)
        self.spilled = {}
        if self.file is not None:
            _unlink(self.file)
            self.file = None
        self._watch(None)
        if self._cleanup is not None:
            self._cleanup()  # an "auto" directory: a later spill makes a fresh one
            self._cleanup, self.directory = None, None

    def _watch(self, path: Path | None) -> None:
        if self._file_cleanup is not None:
            self._file_cleanup.detach()
        self._file_cleanup = None if path is None else weakref.finalize(self, _unlink, path)

    def _spill_directory(self) -> Path:
        if self.setting == "auto" and self.directory is not None and not self.directory.is_dir():
            # A temporary-file cleaner removed it: a fresh one (the mapped file lives on while mapped).
            self._cleanup.detach()
            self._cleanup, self.directory = None, None
        if self.directory is None:
            if self.setting == "auto":
                path = Path(tempfile.mkdtemp(prefix="edgetrain-waiting-"))
                self._cleanup = weakref.finalize(self, shutil.rmtree, str(path), ignore_errors=True)
            else:
                path = Path(self.setting)
            self.directory = path
        return self.directory

    def _write(self, tensors: list[torch.Tensor]) -> Path:
        directory = self._spill_directory()
        path = directory / f"edgetrain-waiting-{os.getpid()}-{id(self):x}-{next(_names)}.pt"
        partial = path.with_name(path.name + ".partial")
        try:
            # A view is saved with its whole storage and loads back as the same view.
            torch.save({str(i): t.detach() for i, t in enumerate(tensors)}, partial)
            os.replace(partial, path)
        except (OSError, RuntimeError) as exc:
            _unlink(partial)
            raise EdgetrainError(f"{self.name}: spill_waiting could not write {path}: {exc}; the waiting "
                                 "weights stay as they were") from exc
        return path

    def _map(self, path: Path) -> dict[str, torch.Tensor]:
        try:
            return torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        except (OSError, RuntimeError) as exc:
            _unlink(path)
            raise EdgetrainError(f"{self.name}: spill_waiting could not map {path}: {exc}; the waiting "
                                 "weights stay as they were") from exc


def _bring_back(tensor: torch.Tensor) -> None:
    # A copy in ordinary memory, with the same strides; the mapping goes when its last tensor does.
    tensor.data = tensor.data.clone()


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:  # already gone, or not ours to remove: nothing maps it any more either way
        pass
