"""Checksummed checkpoints: safetensors files whose tensors and metadata carry a sha256, and their rotation.

A checkpoint damaged after writing (bit rot, a truncated copy) fails its checksum and is reported rather
than loaded; resume then falls back to the newest one that passes (`load_latest_good`). Files are written
crash-safe through edgetrain.files.atomic, whose functions are re-exported here for existing callers.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Callable

import torch

from edgetrain.files.atomic import (
    atomic_torch_save,
    atomic_write_bytes,
    atomic_write_directory,
    atomic_write_file,
    atomic_write_json,
    ensure_writable_directory,
    ensure_writable_target,
    readable_directory,
    remove_stale_temps,
)
from edgetrain.files.user import require_regular_file
from edgetrain.registry import EdgetrainError

__all__ = [
    "CHECKSUM_KEY", "LEGACY_CHECKSUM_KEY", "CorruptCheckpointError", "tensors_sha256", "payload_sha256",
    "atomic_save_safetensors", "load_safetensors_checked", "metadata_json", "check_counters", "check_thread_runs",
    "flatten_optimizer_state", "unflatten_optimizer_state", "rotating_checkpoint_paths", "save_rotating",
    "load_latest_good",
    # re-exported from edgetrain.files.atomic
    "atomic_torch_save", "atomic_write_bytes", "atomic_write_directory", "atomic_write_file",
    "atomic_write_json", "ensure_writable_directory", "ensure_writable_target", "readable_directory",
]

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


def check_thread_runs(state: dict, source: str) -> list[list]:
    """The thread counts a learner checkpoint recorded (edgetrain.training.threads.add_step): [count, steps]
    pairs, count a whole number >= 1 or null (the framework's own), steps >= 1, no more steps in all than
    steps_done. A checkpoint written before they were recorded has none: [] (its steps' counts are unknown)."""
    runs = state.get("threads", [])

    def whole(value: object, least: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= least

    if not isinstance(runs, list) or not all(
            isinstance(run, list) and len(run) == 2 and (run[0] is None or whole(run[0], 1)) and whole(run[1], 1)
            for run in runs):
        raise CorruptCheckpointError(f"{source}: threads must be [count, steps] pairs, got {runs!r}")
    if sum(steps for _, steps in runs) > state["steps_done"]:
        raise CorruptCheckpointError(f"{source}: threads count more steps than steps_done ({state['steps_done']})")
    return runs


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
    try:
        for name, value in tensors.items():
            if name.startswith("optimizer/"):
                _, index, key = name.split("/", 2)
                state.setdefault(int(index), {})[key] = value
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
    remove_stale_temps(path, ".tmp", name_pattern=_ROTATING_NAME)
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
