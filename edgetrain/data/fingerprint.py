"""What a training run was fed, in a few fields a checkpoint can carry: a resumed run that is handed other
data (other files, another sequence length or batch size, another shuffle) is refused by name instead of
going on silently from a stream position that no longer means the same batches."""
from __future__ import annotations

import hashlib
from typing import Any

import torch

from edgetrain.registry import EdgetrainError


class DataChangedError(EdgetrainError, ValueError):
    """A resumed run is given data other than the data its checkpoint was trained on."""


def tensors_digest(*tensors: torch.Tensor) -> str:
    """sha256 of the tensors' dtypes, shapes and contents (the data itself, whatever its file names)."""
    digest = hashlib.sha256()
    for tensor in tensors:
        tensor = tensor.detach().contiguous().cpu()
        digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def check_same_data(saved: dict[str, Any] | None, current: dict[str, Any] | None, source: str,
                    allow_change: bool = False) -> None:
    """Refuse `current` when a checkpoint recorded other data (`saved`); None on either side means the
    data is not known (a checkpoint from before fingerprints, or batches not fed from a stream)."""
    if saved is None or current is None or saved == current or allow_change:
        return
    changes = ["the data's content differs" if key == "sha256" else f"{key} {saved.get(key)!r} -> {current.get(key)!r}"
               for key in sorted(set(saved) | set(current)) if saved.get(key) != current.get(key)]
    raise DataChangedError(f"{source} was trained on other data than this stream ({'; '.join(changes)}); "
                           "resuming would go on from a stream position that no longer means the same batches. "
                           "Use the same data, or allow the change (fit(..., allow_data_change=True), "
                           "edgetrain train --allow-data-change) to continue training on the new data.")
