"""MLXLearner: edgetrain.Learner for MLX decoders, the same learner over the MLX engine
(edgetrain/backends/mlx/engine.py).

    learner = MLXLearner(model, method="mesp", optimizer="adamw", lr=1e-4)
    stats = learner.step(batch)          # StepStats: loss, tokens, seconds, peak memory (MLX probe)
    loss, grads = learner.compute_gradients(batch)   # grads: {name: mx.array} (np.array(g) converts)
    learner.fit(stream, max_steps=100, checkpoint_every=20, checkpoint_dir="ckpt")

edgetrain.Learner(model, backend="mlx", ...) constructs one.
"""
from __future__ import annotations

from typing import Any

from edgetrain.backends.mlx.engine import CHECKPOINT_FORMAT, batch_arrays  # noqa: F401  (re-exported)
from edgetrain.learner import Learner


class MLXLearner(Learner):
    """edgetrain.Learner for MLX models; `backend` must name an MLX backend ("mlx", the default)."""

    framework = "mlx"

    def __init__(self, model: Any, method: str = "bp", backend: str = "mlx", *args: Any, **kwargs: Any) -> None:
        super().__init__(model, method, backend, *args, **kwargs)
