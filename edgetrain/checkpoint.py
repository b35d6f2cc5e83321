"""Atomic, checksummed tensor files: temp file + fsync + rename, sha256 of the tensor payload in metadata.

A reader sees either the previous file or the complete new one, never a torn write; a file damaged later
(bit rot, a truncated copy) fails its checksum and is reported rather than loaded.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import torch

from edgetrain.registry import EdgetrainError

CHECKSUM_KEY = "edgetrain_sha256"


class CorruptCheckpointError(EdgetrainError, OSError):
    """A checkpoint file that is missing, truncated or fails its checksum."""


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().contiguous().cpu()
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def atomic_write_bytes(data: bytes, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return path


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


def atomic_save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path,
                            metadata: dict[str, str] | None = None) -> Path:
    from safetensors.torch import save

    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    meta = dict(metadata or {})
    meta[CHECKSUM_KEY] = tensors_sha256(tensors)
    return atomic_write_bytes(save(tensors, metadata=meta), path)


def load_safetensors_checked(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a file written by atomic_save_safetensors, after verifying its checksum."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise CorruptCheckpointError(f"checkpoint {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
            tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError, OverflowError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(f"checkpoint {path} is damaged or truncated ({exc})") from None
    expected = metadata.get(CHECKSUM_KEY)
    if expected is None:
        raise CorruptCheckpointError(f"checkpoint {path} has no checksum; it was not written by edgetrain")
    if tensors_sha256(tensors) != expected:
        raise CorruptCheckpointError(f"checkpoint {path} fails its checksum (the file was damaged after writing)")
    return tensors, metadata


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
    for index, values in rest["scalars"].items():
        state.setdefault(int(index), {}).update(values)
    return {"state": state, "param_groups": rest["param_groups"]}


def rotating_checkpoint_paths(directory: str | Path) -> list[Path]:
    """Checkpoints written by save_rotating, newest first."""
    return sorted(Path(directory).glob("step-*.safetensors"), reverse=True)


def save_rotating(tensors: dict[str, torch.Tensor], metadata: dict[str, str], directory: str | Path,
                  step: int, keep: int = 2) -> Path:
    """Write step-NNNNNNNN.safetensors atomically, then drop all but the newest `keep`."""
    path = atomic_save_safetensors(tensors, Path(directory) / f"step-{step:08d}.safetensors", metadata)
    for old in rotating_checkpoint_paths(directory)[max(keep, 1):]:
        old.unlink(missing_ok=True)
    return path


def load_latest_good(directory: str | Path, warn=print) -> tuple[Path, dict[str, torch.Tensor], dict[str, str]]:
    """The newest checkpoint in `directory` that passes its checksum; damaged newer ones are reported."""
    candidates = rotating_checkpoint_paths(directory)
    if not candidates:
        raise CorruptCheckpointError(f"no checkpoint (step-*.safetensors) in {directory}")
    problems = []
    for path in candidates:
        try:
            tensors, metadata = load_safetensors_checked(path)
        except CorruptCheckpointError as exc:
            problems.append(str(exc))
            warn(f"edgetrain: skipping {exc}; trying the previous checkpoint")
            continue
        return path, tensors, metadata
    raise CorruptCheckpointError("every checkpoint in " f"{directory} is damaged: " + "; ".join(problems))
