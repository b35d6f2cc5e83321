"""Backends by name: torch-cpu, torch-cuda (and mlx when its adapter is installed)."""
from edgetrain.backends import torch_cpu, torch_cuda  # noqa: F401
from edgetrain.backends.base import BACKENDS, Backend, get_backend

__all__ = ["BACKENDS", "Backend", "get_backend"]
