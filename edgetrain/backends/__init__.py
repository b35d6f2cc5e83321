"""Backends by name: torch-cpu, torch-cuda and mlx (registered always; available where mlx imports).

Each framework's world has one shape: `backends/torch/` and `backends/mlx/` each hold the engine that
does the learner's tensor work (`engine.py`), the backends they register, and what only that framework
needs. What is written once for every framework (the Learner, method configs, adapter formats, data,
probes, export) lives outside both.
"""
from edgetrain.backends import torch as _torch  # noqa: F401  (registers torch-cpu, torch-cuda)
from edgetrain.backends.base import BACKENDS, Backend, get_backend
from edgetrain.backends.mlx import register as _mlx_register  # noqa: F401  (does not import mlx)

__all__ = ["BACKENDS", "Backend", "get_backend"]
