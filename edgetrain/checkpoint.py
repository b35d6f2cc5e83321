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
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
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
