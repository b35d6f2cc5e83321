"""Crash-safe, checksummed files: temp file + fsync + rename, sha256 of the tensors and metadata.

A reader sees either the previous file or the complete new one, never a torn write; a file damaged later
(bit rot, a truncated copy) fails its checksum and is reported rather than loaded. Directories whose files
must match (an adapter's weights and config, ONNX Runtime's artifacts) are built in a temp sibling and
swapped in whole (`atomic_write_directory`).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from edgetrain.registry import EdgetrainError
from edgetrain.user_files import require_regular_file

# The checksum of tensors AND metadata. Files written before it carry LEGACY_CHECKSUM_KEY, a checksum of
# the tensors only: they are still read (their metadata unverified), so existing checkpoints and adapters
# keep loading. A damaged byte cannot turn one key into the other (they differ in length).
CHECKSUM_KEY = "edgetrain_sha256_v2"
LEGACY_CHECKSUM_KEY = "edgetrain_sha256"


class CorruptCheckpointError(EdgetrainError, OSError):
    """A checkpoint file that is missing, truncated or fails its checksum."""


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    return _tensors_digest(tensors).hexdigest()


def _tensors_digest(tensors: dict[str, torch.Tensor]) -> Any:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().contiguous().cpu()
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest


def payload_sha256(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """sha256 of the tensors and of every metadata entry but the checksums, in sorted key order."""
    digest = _tensors_digest(tensors)
    covered = {k: v for k, v in metadata.items() if k not in (CHECKSUM_KEY, LEGACY_CHECKSUM_KEY)}
    digest.update(b"\0metadata\0")
    digest.update(json.dumps(covered, sort_keys=True, ensure_ascii=True).encode())
    return digest.hexdigest()


# -- crash-safe writes ---------------------------------------------------------------------------
# Temp names carry the writer's pid, so the next save of the same path can tell a temp left by a killed
# writer (removed) from one a live writer is still filling (kept).

def _temp_pattern(name: str, suffix: str) -> re.Pattern[str]:
    # .NAME.PID.8HEX.SUFFIX: no other file's temp matches (the 8 hex digits hold no dot).
    return re.compile(rf"\.{re.escape(name)}\.(\d+)\.[0-9a-f]{{8}}{re.escape(suffix)}")


def _make_temp(path: Path, suffix: str, directory: bool) -> Path:
    """A new temp sibling of `path`, created with mode 0666/0777 less the umask (mkstemp's are 0600/0700)."""
    while True:
        tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{suffix}"
        try:
            if directory:
                os.mkdir(tmp, 0o777)
            else:
                os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: someone else's live process
        return True
    return True


def _remove_stale_temps(path: Path, suffix: str, name_pattern: str | None = None) -> None:
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
        if match and not _pid_alive(int(match.group(match.lastindex))):
            _remove(Path(entry.path))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def atomic_write_file(path: str | Path, fill: Callable[[Path], object]) -> Path:
    """Replace file `path` by what `fill(temp_path)` writes there, so that a crash at any moment leaves the
    old file or the complete new one (for writers that want a path rather than bytes: GGUF, big files)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(path, ".tmp")
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
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return path


def atomic_write_bytes(data: bytes, path: str | Path) -> Path:
    """Write `data` to `path` so that a crash at any moment leaves the old file or the complete new one."""
    return atomic_write_file(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_json(value: Any, path: str | Path, indent: int | None = 1) -> Path:
    return atomic_write_bytes(json.dumps(value, indent=indent).encode("utf-8"), path)


def atomic_torch_save(value: Any, path: str | Path) -> Path:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return atomic_write_bytes(buffer.getvalue(), path)


def _fsync_directory(directory: Path) -> None:
    # The rename is durable only once the directory entry is on disk.
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
        _fsync_directory(Path(root))


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
    _remove_stale_temps(path, ".tmpdir")


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


def atomic_write_directory(path: str | Path, fill: Callable[[Path], object]) -> Path:
    """Replace directory `path` by what `fill(temp_dir)` writes, as one step: a reader sees the old
    contents or the complete new ones, never a mix (files of the old directory that `fill` does not write
    are kept). The new directory is built in a temp sibling, then swapped in by two renames:
    path -> .NAME.old, temp -> path. A crash between them leaves .NAME.old complete; readers use it
    (readable_directory) and the next save of `path` renames it back before anything else."""
    path = Path(path)
    if path.is_symlink():
        path = path.resolve()
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} exists and is not a directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    _recover_directory(path)
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
    _fsync_directory(path.parent)
    shutil.rmtree(backup, ignore_errors=True)
    return path


# -- checksummed safetensors ---------------------------------------------------------------------

def atomic_save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path,
                            metadata: dict[str, str] | None = None) -> Path:
    from safetensors.torch import save

    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    meta = {k: v for k, v in (metadata or {}).items() if k not in (CHECKSUM_KEY, LEGACY_CHECKSUM_KEY)}
    meta[CHECKSUM_KEY] = payload_sha256(tensors, meta)
    return atomic_write_bytes(save(tensors, metadata=meta), path)


def load_safetensors_checked(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a file written by atomic_save_safetensors, after verifying its checksum."""
    from safetensors import SafetensorError, safe_open

    path = require_regular_file(path, CorruptCheckpointError, "the checkpoint")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
            tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError, OverflowError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(f"checkpoint {path} is damaged or truncated ({exc})") from None
    if CHECKSUM_KEY in metadata:
        actual, expected = payload_sha256(tensors, metadata), metadata[CHECKSUM_KEY]
    elif LEGACY_CHECKSUM_KEY in metadata:
        actual, expected = tensors_sha256(tensors), metadata[LEGACY_CHECKSUM_KEY]
    else:
        raise CorruptCheckpointError(f"checkpoint {path} has no checksum; it was not written by edgetrain")
    if actual != expected:
        raise CorruptCheckpointError(f"checkpoint {path} fails its checksum (the file was damaged after writing)")
    return tensors, metadata


def metadata_json(metadata: dict[str, str], key: str, source: str, required: tuple[str, ...] = ()) -> dict:
    """metadata[key] parsed as a JSON object holding every key in `required`; anything else means the
    checkpoint is damaged (CorruptCheckpointError, so that resume falls back to the previous one)."""
    try:
        value = json.loads(metadata[key])
    except KeyError:
        raise CorruptCheckpointError(f"{source}: metadata {key!r} is missing") from None
    except (json.JSONDecodeError, TypeError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{source}: metadata {key!r} is not valid JSON ({exc!r})") from None
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{source}: metadata {key!r} is not a JSON object")
    missing = [name for name in required if name not in value]
    if missing:
        raise CorruptCheckpointError(f"{source}: metadata {key!r} lacks {', '.join(missing)}")
    return value


def check_counters(state: dict, source: str) -> None:
    """steps_done and stream_position of a learner checkpoint are whole numbers >= 0 (JSON could hold
    anything: a crafted file is refused like a damaged one)."""
    for key in ("steps_done", "stream_position"):
        value = state.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CorruptCheckpointError(f"{source}: {key} must be a whole number >= 0, got {value!r}")


def flatten_optimizer_state(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Split torch optimizer state into tensors (for safetensors) and a JSON-able remainder."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, object]] = {}
    for index, per_param in state["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer/{index}/{key}"] = value
            else:
                scalars.setdefault(str(index), {})[key] = value
    return tensors, {"scalars": scalars, "param_groups": state["param_groups"]}


def unflatten_optimizer_state(tensors: dict[str, torch.Tensor], rest: dict) -> dict:
    state: dict[int, dict[str, object]] = {}
    for name, value in tensors.items():
        if name.startswith("optimizer/"):
            _, index, key = name.split("/", 2)
            state.setdefault(int(index), {})[key] = value
    try:
        for index, values in rest["scalars"].items():
            state.setdefault(int(index), {}).update(values)
        return {"state": state, "param_groups": rest["param_groups"]}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptCheckpointError(f"optimizer state in the checkpoint metadata is damaged ({exc!r})") from None


_ROTATING_NAME = r"step-(\d+)\.safetensors"


def rotating_checkpoint_paths(directory: str | Path) -> list[Path]:
    """Checkpoints written by save_rotating, newest first: regular files named step-<digits>.safetensors
    (a stray directory or `step-old.safetensors` is not one, and is neither loaded nor rotated away)."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    steps = []
    for entry in entries:
        match = re.fullmatch(_ROTATING_NAME, entry.name)
        if match and entry.is_file():
            steps.append((int(match.group(1)), entry.name))
    return [Path(directory) / name for _, name in sorted(steps, reverse=True)]


def save_rotating(tensors: dict[str, torch.Tensor], metadata: dict[str, str], directory: str | Path,
                  step: int, keep: int = 2) -> Path:
    """Write step-NNNNNNNN.safetensors atomically, then drop all but the newest `keep`, and the temps of
    earlier saves whose writer was killed (each save has its own name, so no later save of that name
    would find them)."""
    path = atomic_save_safetensors(tensors, Path(directory) / f"step-{step:08d}.safetensors", metadata)
    for old in rotating_checkpoint_paths(directory)[max(keep, 1):]:
        old.unlink(missing_ok=True)
    _remove_stale_temps(path, ".tmp", name_pattern=_ROTATING_NAME)
    return path


def ensure_writable_directory(directory: str | Path, what: str) -> Path:
    """`directory`, created if absent, after proving a file can be written in it: a run finds out that its
    checkpoints or its adapter cannot be saved before it trains, not at the first save."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = _make_temp(directory / ".write-test", ".tmp", directory=False)
        probe.unlink()
    except OSError as exc:
        raise EdgetrainError(f"{what} {directory} is not a writable directory ({exc.strerror or exc})") from None
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


def load_latest_good(directory: str | Path, warn: Callable[[str], object] = print,
                     restore: Callable[[Path, dict[str, torch.Tensor], dict[str, str]], object] | None = None,
                     ) -> tuple[Path, dict[str, torch.Tensor], dict[str, str]]:
    """The newest checkpoint in `directory` that passes its checksum (and that `restore`, when given,
    accepts without CorruptCheckpointError); damaged newer ones are reported through `warn`."""
    candidates = rotating_checkpoint_paths(directory)
    if not candidates:
        raise CorruptCheckpointError(f"no checkpoint (step-*.safetensors) in {directory}")
    problems = []
    for path in candidates:
        try:
            tensors, metadata = load_safetensors_checked(path)
            if restore is not None:
                restore(path, tensors, metadata)
        except CorruptCheckpointError as exc:
            reason = str(exc) if str(path) in str(exc) else f"{path}: {exc}"
            problems.append(reason)
            warn(f"skipping {reason}; trying the previous checkpoint")
            continue
        return path, tensors, metadata
    raise CorruptCheckpointError("every checkpoint in " f"{directory} is damaged: " + "; ".join(problems))
