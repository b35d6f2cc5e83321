"""torch on a CUDA GPU (a server GPU, or the Jetson AGX Orin's integrated one)."""
from __future__ import annotations

from edgetrain.backends.base import BACKENDS, Backend

# torch is imported when the backend is used, not when it registers (edgetrain.backends.base): the CLI's
# --help and every torch-free import of edgetrain.backends stay torch-free.


def _availability() -> tuple[bool, str]:
    import torch

    if not torch.backends.cuda.is_built():
        return False, "this torch build has no CUDA support (a CPU wheel)"
    if not torch.cuda.is_available():
        return False, "no CUDA device is visible (torch.cuda.is_available() is False)"
    return True, ""


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


BACKENDS.add("torch-cuda", Backend(name="torch-cuda", framework="torch", device="cuda",
                                   synchronize=_synchronize,
                                   availability=_availability, probe=lambda: "cuda", quantized_base=True))
