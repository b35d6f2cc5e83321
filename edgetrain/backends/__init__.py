"""Backends by name: torch-cpu, torch-cuda and mlx (registered always; available where mlx imports)."""
from edgetrain.backends import torch_cpu, torch_cuda  # noqa: F401
from edgetrain.backends.base import BACKENDS, Backend, get_backend
from edgetrain.backends.mlx import register as _mlx_register  # noqa: F401  (does not import mlx)

__all__ = ["BACKENDS", "Backend", "get_backend"]
