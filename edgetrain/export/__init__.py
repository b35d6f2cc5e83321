"""Export a learner's trainable part to on-device training runtimes (the `export` extra).

    from edgetrain.export import export_training, load_trainer
    model = edgetrain.load_model("mlp-digits"); make_trainable(model, "head")
    export_training(model, batch, "executorch", "head.pte")        # joint forward-backward .pte
    export_training(model, batch, "onnxruntime", "head-ort/")      # ORT training artifacts
    trainer = load_trainer("executorch", "head.pte", lr=0.1, batch=batch)
    loss = trainer.step(batch)                                       # SGD step inside the runtime

Runtimes: "executorch" (edgetrain/export/executorch.py, the only file with ExecuTorch's experimental
calls) and "onnxruntime" (edgetrain/export/onnxrt.py). Both take the same loss-inside module
(edgetrain/export/trainable.py) and reproduce, step for step, a torch Learner with plain SGD.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from edgetrain.data.batch import Batch
from edgetrain.export.stream_file import read_batch_file, read_runner_parameters, write_batch_file
from edgetrain.export.trainable import (TRAINABLE_PARTS, BatchSignature, ExportError, LossModule, default_part,
                                        example_batch, make_trainable, torch_sgd_trajectory)

RUNTIMES = ("executorch", "onnxruntime")

__all__ = ["BatchSignature", "ExportError", "LossModule", "RUNTIMES", "RuntimeTrainer", "TRAINABLE_PARTS",
           "default_part", "example_batch", "export_training", "load_trainer", "make_trainable",
           "read_batch_file", "read_runner_parameters", "torch_sgd_trajectory", "write_batch_file"]


class RuntimeTrainer(Protocol):
    runtime: str

    def step(self, batch: Batch) -> float:
        """Forward + backward inside the runtime, then its SGD update; the loss before the update."""

    def parameters(self) -> dict[str, torch.Tensor]:
        """The trainable weights by the model's own parameter names."""


def _check_runtime(runtime: str) -> None:
    if runtime not in RUNTIMES:
        raise ExportError(f"unknown runtime {runtime!r}; known runtimes: {', '.join(RUNTIMES)}")


def export_training(model: nn.Module, batch: Batch, runtime: str, path: str | Path) -> Path:
    """Export `model` (trainable weights = requires_grad) for batches shaped like `batch` to `path`:
    a .pte file (executorch) or an artifact directory (onnxruntime)."""
    _check_runtime(runtime)
    if runtime == "executorch":
        from edgetrain.export.executorch import export_executorch

        export_executorch(model, batch, path)
        return Path(path)
    from edgetrain.export.onnxrt import export_onnxruntime

    return export_onnxruntime(model, batch, path)


def load_trainer(runtime: str, path: str | Path, lr: float, batch: Batch | None = None) -> RuntimeTrainer:
    """A trainer over an exported program; with `batch`, every step's batch is checked against its shape."""
    _check_runtime(runtime)
    if runtime == "executorch":
        from edgetrain.export.executorch import ExecuTorchTrainer

        return ExecuTorchTrainer(path, lr, batch)
    from edgetrain.export.onnxrt import OrtTrainer

    return OrtTrainer(path, lr, batch)
