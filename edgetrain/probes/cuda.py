"""CUDA: what torch's caching allocator holds on one device.

"allocated" is the bytes in blocks handed to tensors (rounded up to the allocator's 512-byte
granularity) -- deterministic, step after step. "reserved" is what the allocator has taken from
the driver, cached free blocks included -- what the GPU really has less of, but it only grows when
the cache misses. Neither includes the CUDA context or cuBLAS/cuDNN workspaces outside the allocator.
"""
from __future__ import annotations

from typing import Literal

import torch

from edgetrain.probes.base import PROBES, require_available


def cuda_availability() -> tuple[bool, str]:
    if not torch.backends.cuda.is_built():
        return False, "this torch build has no CUDA support (a CPU wheel)"
    if not torch.cuda.is_available():
        return False, "no CUDA device is visible (torch.cuda.is_available() is False)"
    return True, ""


@PROBES.register("cuda")
class CudaProbe:
    """Peak and current bytes of torch's CUDA caching allocator on one device."""

    name = "cuda"

    def __init__(self, device: int | str | torch.device | None = None, *,
                 counts: Literal["allocated", "reserved"] = "allocated") -> None:
        if counts not in ("allocated", "reserved"):
            raise ValueError(f"counts must be 'allocated' or 'reserved', not {counts!r}")
        self.device = device  # None: the current device, resolved by torch at each call
        self.counts = counts

    def available(self) -> tuple[bool, str]:
        ok, reason = cuda_availability()
        if not ok:
            return ok, reason
        if isinstance(self.device, int):
            index: int | None = self.device
        elif self.device is None:
            index = None
        else:
            try:
                device = torch.device(self.device)
            except RuntimeError as exc:
                return False, f"bad CUDA device {self.device!r}: {exc}"
            if device.type != "cuda":
                return False, f"device {self.device!r} is not a CUDA device"
            index = device.index
        if index is not None and not 0 <= index < torch.cuda.device_count():
            return False, f"CUDA device {index} does not exist ({torch.cuda.device_count()} visible)"
        return True, ""

    def reset_peak(self) -> None:
        require_available(self)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int:
        require_available(self)
        if self.counts == "reserved":
            return torch.cuda.max_memory_reserved(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def current_bytes(self) -> int:
        require_available(self)
        if self.counts == "reserved":
            return torch.cuda.memory_reserved(self.device)
        return torch.cuda.memory_allocated(self.device)
