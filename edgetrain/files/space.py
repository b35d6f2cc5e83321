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


def disk_full_error(path: str | Path, needed: int | None = None, what: str = "output") -> DiskFullError:
    """The error for `path` not fitting on its disk; `needed` the bytes it takes (None: not known ahead)."""
    free = free_bytes(Path(path).parent)
    needs = f"it needs {_size(needed)}" if needed is not None else "it did not fit"
    has = f", {_size(free)} free" if free is not None else ""
    target = f"{what} {path}" if what != "output" else str(path)
    return DiskFullError(f"no space left on the device to write {target}: {needs}{has} in {Path(path).parent}; "
                         "nothing already there was changed (free some space and run it again)")


def check_free_space(path: str | Path, needed: int, what: str = "output") -> None:
    """Refuse, before writing anything, a file of `needed` bytes that the disk holding `path` cannot take."""
    free = free_bytes(Path(path).parent)
    if free is not None and needed > free:
        raise disk_full_error(path, needed, what)
