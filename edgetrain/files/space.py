"""A full disk, said as such: which path could not be written, how much it needed (when known) and how much
is free. Phones and Jetsons fill their storage all the time; a raw `OSError: [Errno 28]` from deep inside
a writer says none of that.

Every writer in edgetrain goes through edgetrain.files.atomic, which turns ENOSPC / EDQUOT into
DiskFullError after removing its temp (the previous file is untouched: it is only ever replaced by a
rename); writers that know their size ahead call check_free_space first and refuse before writing.
"""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any, Iterable, Mapping

from edgetrain.registry import EdgetrainError

_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
MIB = 2**20


class DiskFullError(EdgetrainError, OSError):
    """No space left where a file is written. An OSError too (errno ENOSPC), for callers that handle the
    file system's own errors."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.errno = errno.ENOSPC


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _FULL


def says_disk_full(exc: BaseException) -> bool:
    """A full disk, as the file system says it (ENOSPC, EDQUOT) or as a native library that only puts it in
    its message says it (ONNX Runtime's checkpoint writer: "error:No space left on device errno:28")."""
    return is_disk_full(exc) or os.strerror(errno.ENOSPC) in str(exc)


def free_bytes(path: str | Path) -> int | None:
    """Bytes free to an unprivileged writer on the file system holding `path` (its nearest existing
    directory); None where it cannot be read."""
    directory = Path(path)
    while not directory.is_dir() and directory != directory.parent:
        directory = directory.parent
    try:
        stats = os.statvfs(directory)
        return stats.f_bavail * stats.f_frsize
    except (OSError, AttributeError):  # no statvfs (Windows): shutil's total
        try:
            return shutil.disk_usage(directory).free
        except OSError:
            return None


def _size(count: int) -> str:
    return f"{count / MIB:.1f} MiB" if count >= MIB else f"{count:,} bytes"


def disk_full_error(path: str | Path, needed: int | None = None, what: str = "output",
                    beside: Iterable[str | Path] = (), part_way: bool = False) -> DiskFullError:
    """The error for `path` not fitting on its disk; `needed` the bytes it takes (None: not known ahead), with
    the files written together with it on the same disk (`beside`) when there are any. `part_way`: the write
    itself ran out (`needed`, if given, was only what it takes at least: the free space looked enough)."""
    free = free_bytes(Path(path).parent)
    if part_way or needed is None:
        needs = "it did not fit" + (f" (it needs at least {_size(needed)})" if needed is not None else "")
    else:
        needs = f"it needs {_size(needed)}"
    has = f", {_size(free)} free" if free is not None else ""
    target = f"{what} {path}" if what != "output" else str(path)
    others = [Path(other).name for other in beside]
    if others:
        target += f" and {', '.join(others)} beside it"
        needs = needs.replace("it needs", "they need")
    return DiskFullError(f"no space left on the device to write {target}: {needs}{has} in {Path(path).parent}; "
                         "nothing already there was changed (free some space and run it again)")


def check_free_space(path: str | Path, needed: int, what: str = "output") -> None:
    """Refuse, before writing anything, a file of `needed` bytes that the disk holding `path` cannot take."""
    free = free_bytes(Path(path).parent)
    if free is not None and needed > free:
        raise disk_full_error(path, needed, what)


def _device(path: Path) -> int | None:
    directory = path
    while not directory.is_dir() and directory != directory.parent:
        directory = directory.parent
    try:
        return os.stat(directory).st_dev
    except OSError:
        return None


def check_room_for(files: Mapping[str | Path, int], what: str = "output") -> None:
    """Refuse, before any of them is written, files that must all be written together (a program and its
    weights file) when the disk holding them cannot take them all: a crash-safe write holds the new file
    beside the old one until its rename, so each needs its full size free, and files on one disk add up.
    The error names the first file of the disk that is short, with what the files on that disk need."""
    by_disk: dict[int | None, list[tuple[Path, int]]] = {}
    for path, needed in files.items():
        by_disk.setdefault(_device(Path(path)), []).append((Path(path), int(needed)))
    for disk in by_disk.values():
        total = sum(needed for _, needed in disk)
        free = free_bytes(disk[0][0].parent)
        if free is not None and total > free:
            raise disk_full_error(disk[0][0], total, what, beside=[path for path, _ in disk[1:]])


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """The bytes of the tensors' data (torch, NumPy or MLX arrays; a tensor shared under two names counted
    once): what a file holding them takes at least, known before any of it is serialised."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for tensor in tensors:
        pointer = getattr(tensor, "data_ptr", None)
        if callable(pointer):  # torch: tied weights are one storage
            key = (pointer(), tensor.numel())
            if key in seen and key[0]:  # 0: no storage of its own (empty, meta), never shared
                continue
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
        else:
            total += int(getattr(tensor, "nbytes", 0))
    return total
