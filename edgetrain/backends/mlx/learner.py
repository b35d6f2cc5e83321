"""Deprecated: MLXLearner. There is one learner, edgetrain.Learner, and `backend="mlx"` runs it over the
MLX engine (edgetrain/backends/mlx/engine.py):

    learner = edgetrain.Learner(model, method="mesp", backend="mlx", optimizer="adamw", lr=1e-4)

`MLXLearner(model, ...)` still works for one release: it warns (DeprecationWarning) and returns that
Learner, with backend "mlx" unless another is named.
"""
from __future__ import annotations

import warnings
from typing import Any

from edgetrain.backends.mlx.engine import CHECKPOINT_FORMAT, batch_arrays  # noqa: F401  (re-exported)
from edgetrain.training.learner import Learner


def MLXLearner(model: Any, method: str = "bp", backend: str = "mlx", *args: Any, **kwargs: Any) -> Learner:  # noqa: N802
    """Deprecated: edgetrain.Learner(model, method, backend="mlx", ...)."""
    warnings.warn("MLXLearner is deprecated and will be removed: use edgetrain.Learner(model, backend=\"mlx\", ...), "
                  "the same learner", DeprecationWarning, stacklevel=2)
    return Learner(model, method, backend, *args, **kwargs)
