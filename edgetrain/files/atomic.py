"""Crash-safe writes of files and directories: a crash at any moment leaves the old version or the new one.

A reader never sees a torn write. Files are written to a temp sibling, fsynced and renamed over the target;
directories whose files must match (an adapter's weights and config, ONNX Runtime's artifacts) are built in
a temp sibling and swapped in whole (`atomic_write_directory`). Temps left by killed writers, of any file,
are removed by the next write into their directory (only edgetrain's own temp names, only dead writers'). Checksummed checkpoints on top of these writes live in edgetrain.training.checkpoint.
"""
from __future__ import annotations

import errno
import io
import json
import os
import re
import secrets
import shutil
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from edgetrain.files.space import check_free_space, disk_full_error, free_bytes, is_disk_full
from edgetrain.registry import EdgetrainError

class OutputPathError(EdgetrainError, OSError):
    """An output path that cannot be written: it names the part of the path that is wrong (a file where a
    directory must be, a folder that cannot be written in, a name the file system refuses). An OSError
    too, for callers that handle the file system's own errors."""


def _first_existing_ancestor(path: Path) -> Path:
    for ancestor in path.parents:
        if os.path.lexists(ancestor):
            return ancestor
    return Path(path.anchor or ".")


def output_path_error(path: Path, exc: OSError | ValueError, what: str = "output") -> OutputPathError:
    """The named error for writing `path` failing with `exc` at its directory (creating it, or a file in it)."""
    if isinstance(exc, ValueError):  # a NUL byte: no file system takes it
        return OutputPathError(f"{what} {str(path)!r} cannot be written: {exc}")
    blocker = _first_existing_ancestor(path)
    if not blocker.is_dir():
        kind = "a file" if blocker.is_file() else "not a directory"
        return OutputPathError(f"{what} {path} cannot be written: {blocker} is {kind}, and a directory must be "
                               "there")
    reason = exc.strerror or str(exc)
    if blocker != path.parent:
        return OutputPathError(f"{what} {path} cannot be written: cannot create {path.parent} inside {blocker} "
                               f"({reason})")
    return OutputPathError(f"{what} {path} cannot be written in {blocker} ({reason})")


def make_directory(directory: str | Path, what: str = "directory") -> Path:
    """Create `directory` (and the ones above it): a full disk is a DiskFullError naming it, any other failure
    an OutputPathError naming the part of the path that stops it."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as exc:
        if is_disk_full(exc):
            raise disk_full_error(directory, what=what) from None
        raise output_path_error(directory, exc, what) from None
    return directory


def make_parent(path: Path, what: str = "output") -> None:
    """Create `path`'s directory (and the ones above it), or raise OutputPathError naming the part of the
    path that stops it (DiskFullError when the disk is full)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as exc:
        if is_disk_full(exc):
            raise disk_full_error(path.parent, what="directory") from None
        raise output_path_error(path, exc, what) from None
    if not path.parent.is_dir():  # mkdir(exist_ok=True) accepts a symlink to a file
        raise output_path_error(path, NotADirectoryError(20, "Not a directory"), what)
    try:  # the name itself: one the file system refuses (too long, a NUL byte) fails here, by name
        os.lstat(path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        raise output_path_error(path, exc, what) from None


# Temp names carry the writer's pid, so that a later write into the same directory can tell a temp left by
# a killed writer (removed) from one a live writer is still filling (kept).

def _temp_pattern(name: str, suffix: str) -> re.Pattern[str]:
    # .NAME.PID.8HEX.SUFFIX: no other file's temp matches (the 8 hex digits hold no dot).
    return re.compile(rf"\.{re.escape(name)}\.(\d+)\.[0-9a-f]{{8}}{re.escape(suffix)}")


# Any temp of edgetrain's naming, whatever file it was for: a checkpoint's name changes with its step, so a
# temp of a killed save is rarely the temp of the next save's own path.
_ANY_TEMP = re.compile(r"\.(.+)\.(\d+)\.[0-9a-f]{8}(\.tmp|\.tmpdir)")

# The temps this process is filling now, by name (random enough to be unique, and the same however the
# directory is spelt). A temp named with this process's pid that is not among them was
# left by an earlier process that had the same pid: a container or an app restarted after a kill gets the
# same pids every time, so the killed writer's pid is often the rerun's own.
_OWN_TEMPS: set[str] = set()
_OWN_TEMPS_LOCK = threading.Lock()


def _make_temp(path: Path, suffix: str, directory: bool) -> Path:
    """A new temp sibling of `path`, created with mode 0666/0777 less the umask (mkstemp's are 0600/0700);
    OutputPathError when the directory takes no new file (read-only, full, a name too long). Pass it to
    _release_temp once it is renamed or removed."""
    while True:
        tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{suffix}"
        with _OWN_TEMPS_LOCK:
            _OWN_TEMPS.add(tmp.name)
        try:
            if directory:
                os.mkdir(tmp, 0o777)
            else:
                os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            _release_temp(tmp)
            continue
        except BaseException as exc:
            _release_temp(tmp)
            if is_disk_full(exc):
                raise disk_full_error(path) from None
            if isinstance(exc, (OSError, ValueError)):
                raise output_path_error(path, exc) from None
            raise


def _release_temp(tmp: Path) -> None:
    with _OWN_TEMPS_LOCK:
        _OWN_TEMPS.discard(Path(tmp).name)


def _linux_process(pid: int) -> tuple[str, float] | None:
    """(state, start time in seconds since the epoch) of process `pid` from /proc, or None where /proc
    cannot say (not Linux, or no such process: _pid_alive then asks the kernel)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
        with open("/proc/stat", "rb") as handle:
            boot = next(float(line.split()[1]) for line in handle if line.startswith(b"btime "))
        return fields[0].decode(), boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, StopIteration):
        return None


# How much earlier than a process's start a temp's last write may look and still be that process's: the
# clocks of a file's mtime and of a process's start are read differently (and coarsely).
_START_SLACK_SECONDS = 5.0


def _pid_alive(pid: int, written_at: float | None = None) -> bool:
    """Whether the writer with `pid` may still be at work on a temp last written at `written_at` (its
    mtime): a live process that is not a zombie and, where /proc tells, that started before that write
    (a pid taken again by a process started later is not the writer)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # PermissionError: someone else's live process
        pass
    process = _linux_process(pid)
    if process is None:
        return True
    state, started = process
    if state in ("Z", "X"):  # killed, not yet reaped by its parent: it writes nothing more
        return False
    return written_at is None or started <= written_at + _START_SLACK_SECONDS


def _stale(entry: os.DirEntry, pid: int, suffix: str) -> bool:
    """A temp of edgetrain's naming whose writer is gone: the right kind (a .tmp a plain file, a .tmpdir a
    directory, neither a symlink), and its pid is not a live writer that could still be filling it."""
    try:
        kind_ok = entry.is_dir(follow_symlinks=False) if suffix == ".tmpdir" else entry.is_file(follow_symlinks=False)
        if not kind_ok:
            return False
        written_at = entry.stat(follow_symlinks=False).st_mtime
    except OSError:
        return False
    if pid == os.getpid():
        with _OWN_TEMPS_LOCK:
            return entry.name not in _OWN_TEMPS
    return not _pid_alive(pid, written_at)


def remove_stale_temps_in(directory: Path) -> None:
    """Remove from `directory` every temp of edgetrain's naming (.NAME.PID.8HEX.tmp / .tmpdir, for any NAME)
    left by a writer no longer alive; any other file, and the temps of live writers, are kept."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        match = _ANY_TEMP.fullmatch(entry.name)
        if match and _stale(entry, int(match.group(2)), match.group(3)):
            _remove(Path(entry.path))


def remove_stale_temps(path: Path, suffix: str, name_pattern: str | None = None) -> None:
    """Remove the temps of `path` (or, with `name_pattern`, of every sibling whose name matches it) that
    were left by writers no longer alive."""
    pattern = (_temp_pattern(path.name, suffix) if name_pattern is None else
               re.compile(rf"\.{name_pattern}\.(\d+)\.[0-9a-f]{{8}}{re.escape(suffix)}"))
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match and _stale(entry, int(match.group(match.lastindex)), suffix):
            _remove(Path(entry.path))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def atomic_write_file(path: str | Path, fill: Callable[[Path], object], needed: int | None = None) -> Path:
    """Replace file `path` by what `fill(temp_path)` writes there, so that a crash at any moment leaves the
    old file or the complete new one (for writers that want a path rather than bytes: GGUF, big files).
    A full disk (ENOSPC, EDQUOT) is a DiskFullError naming the path, with the temp removed and the old file
    as it was; `needed`, the bytes it will take when known, is checked against the free space first."""
    path = Path(path)
    try:
        return _atomic_write_file(path, fill, needed)
    except OSError as exc:
        if is_disk_full(exc) and not isinstance(exc, EdgetrainError):
            raise disk_full_error(path, needed, part_way=True) from None
        raise


def _atomic_write_file(path: Path, fill: Callable[[Path], object], needed: int | None) -> Path:
    make_parent(path)
    if os.path.isdir(path):  # os.path's: False, not an OSError, for a name the file system refuses
        raise OutputPathError(f"output {path} is a directory; a file is written there")
    remove_stale_temps_in(path.parent)
    if needed is not None:
        check_free_space(path, needed)
    tmp_name = _make_temp(path, ".tmp", directory=False)
    try:
        if path.is_file():
            shutil.copymode(path, tmp_name)
        fill(tmp_name)
        descriptor = os.open(tmp_name, os.O_RDONLY)  # fsync needs no write access, only the file
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.replace(tmp_name, path)
    except BaseException as exc:
        short = _short_write_on_a_full_disk(exc, path)  # asked before the temp gives its space back
        Path(tmp_name).unlink(missing_ok=True)
        if short:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from exc
        raise
    finally:
        _release_temp(tmp_name)
    fsync_directory(path.parent)
    return path


# Below this, a write that came up short (an OSError without an errno, as writers that count their bytes
# raise) is taken for a full disk.
_NEARLY_NOTHING_FREE = 64 * 1024


def _short_write_on_a_full_disk(exc: BaseException, path: Path) -> bool:
    if not isinstance(exc, OSError) or exc.errno is not None:
        return False
    free = free_bytes(path.parent)
    return free is not None and free < _NEARLY_NOTHING_FREE


def atomic_write_bytes(data: bytes, path: str | Path) -> Path:
    """Write `data` to `path` so that a crash at any moment leaves the old file or the complete new one; a
    disk without room for it is refused before anything is written (DiskFullError)."""
    return atomic_write_file(path, lambda tmp: tmp.write_bytes(data), needed=len(data))


def atomic_write_json(value: Any, path: str | Path, indent: int | None = 1) -> Path:
    return atomic_write_bytes(json.dumps(value, indent=indent).encode("utf-8"), path)


def atomic_torch_save(value: Any, path: str | Path) -> Path:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return atomic_write_bytes(buffer.getvalue(), path)


def fsync_directory(directory: Path) -> None:
    """Flush a directory's entries to disk (a rename is durable only then); a no-op where the platform
    cannot open or sync a directory."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(directory: Path) -> None:
    for root, _, files in os.walk(directory):
        for name in files:
            with open(os.path.join(root, name), "rb") as handle:
                os.fsync(handle.fileno())
        fsync_directory(Path(root))


def _backup_path(path: Path) -> Path:
    return path.parent / f".{path.name}.old"


def readable_directory(path: str | Path) -> Path:
    """Where the complete contents of a directory written by atomic_write_directory are: `path`, or, after
    a crash that fell between the swap's two renames, the previous version it was moved aside to."""
    path = Path(path)
    backup = _backup_path(path)
    return backup if not path.exists() and backup.is_dir() else path


def _recover_directory(path: Path) -> None:
    backup = _backup_path(path)
    if backup.is_dir():
        if path.exists():  # the swap finished; removing the old version did not
            shutil.rmtree(backup, ignore_errors=True)
        else:  # killed between the renames: put the previous complete version back
            os.replace(backup, path)
    remove_stale_temps_in(path.parent)


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _carry_over(old: Path, new: Path) -> None:
    """Entries of the old directory that the writer did not write itself (a user's other files) go into
    the new one as hard links or copies: the old directory stays complete until the swap."""
    for entry in os.scandir(old):
        target = new / entry.name
        if os.path.lexists(target):
            continue
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), target)
        elif entry.is_dir():
            shutil.copytree(entry.path, target, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry.path, str(target))


def atomic_write_directory(path: str | Path, fill: Callable[[Path], object], needed: int | None = None) -> Path:
    """Replace directory `path` by what `fill(temp_dir)` writes, as one step: a reader sees the old
    contents or the complete new ones, never a mix (files of the old directory that `fill` does not write
    are kept). The new directory is built in a temp sibling, then swapped in by two renames:
    path -> .NAME.old, temp -> path. A crash between them leaves .NAME.old complete; readers use it
    (readable_directory) and the next save of `path` renames it back before anything else. A full disk is a
    DiskFullError naming the directory, with the temp removed and the old directory as it was; `needed`, what
    the new contents take at least when known (their tensors' bytes), is checked against the free space
    before `fill` runs."""
    try:
        return _atomic_write_directory(Path(path), fill, needed)
    except OSError as exc:
        if is_disk_full(exc) and not isinstance(exc, EdgetrainError):
            raise disk_full_error(Path(path), needed, what="directory", part_way=True) from None
        raise


def _atomic_write_directory(path: Path, fill: Callable[[Path], object], needed: int | None) -> Path:
    make_parent(path)
    if path.is_symlink():
        path = path.resolve()
    if path.exists() and not path.is_dir():
        raise OutputPathError(f"output {path} exists and is not a directory; a directory is written there")
    _recover_directory(path)
    if needed is not None:
        check_free_space(path, needed, "directory")
    tmp = _make_temp(path, ".tmpdir", directory=True)
    backup = _backup_path(path)
    moved_aside = False
    try:
        if path.is_dir():
            shutil.copymode(path, tmp)
        fill(tmp)
        if path.is_dir():
            _carry_over(path, tmp)
        _fsync_tree(tmp)
        if path.is_dir():
            os.replace(path, backup)
            moved_aside = True
        os.replace(tmp, path)
        moved_aside = False
    except BaseException:
        if moved_aside and not path.exists():
            os.replace(backup, path)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        _release_temp(tmp)
    fsync_directory(path.parent)
    shutil.rmtree(backup, ignore_errors=True)
    return path


def ensure_writable_directory(directory: str | Path, what: str) -> Path:
    """`directory`, created if absent, after proving a file can be written in it: a run finds out that its
    checkpoints or its adapter cannot be saved before it trains, not at the first save."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not directory.is_dir():
            raise NotADirectoryError(20, "Not a directory")
        probe = _make_temp(directory / ".write-test", ".tmp", directory=False)
        try:
            probe.unlink()
        finally:
            _release_temp(probe)
    except (OSError, ValueError) as exc:
        blocker = _first_existing_ancestor(directory / ".write-test")
        if not blocker.is_dir():
            raise OutputPathError(f"{what} {directory} is not a writable directory: {blocker} is a file") from None
        reason = (exc.strerror if isinstance(exc, OSError) else None) or str(exc)
        raise OutputPathError(f"{what} {directory} is not a writable directory ({reason})") from None
    return directory


def ensure_writable_target(path: str | Path, what: str, directory: bool = False) -> Path:
    """Check before any work that `path` can be saved: its parent is a writable directory and `path` is not
    already something else (a directory where a file goes, or the reverse)."""
    path = Path(path)
    if path.exists() and path.is_dir() != directory:
        kind = "a directory" if path.is_dir() else "a file"
        raise EdgetrainError(f"{what} {path} is {kind}; it must be {'a directory' if directory else 'a file'}")
    ensure_writable_directory(path.parent, f"the directory of {what}")
    return path
