"""ONNX Runtime training artifacts (`onnxruntime.training.artifacts.generate_artifacts`) and their runtime.

Needs the `export` extra: onnx==1.17.0 (ONNX Runtime 1.19 rejects the IR versions newer onnx writes) and
onnxruntime-training-cpu==1.19.2. Upstream deprecated this training API after 1.19, so it is optional.

The loss-inside module (edgetrain.export.trainable.LossModule) is exported to ONNX with torch's
TorchScript exporter (no extra dependency), then `generate_artifacts` adds the gradient graph with no
loss block of its own (the model's output already is the loss) and an SGD optimizer graph:

    DIR/training_model.onnx  DIR/eval_model.onnx  DIR/optimizer_model.onnx  DIR/checkpoint
"""
from __future__ import annotations

import contextlib
import errno
import io
import math
import os
import warnings
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from edgetrain.files.space import says_disk_full
from edgetrain.training.checkpoint import atomic_write_directory, readable_directory
from edgetrain.data.batch import Batch
from edgetrain.export.trainable import (WRAPPED_PREFIX, BatchSignature, ExportError, LossModule, require,
                                        strip_prefix, trainable_names)

OPSET = 17
ARTIFACTS = ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint")


def _require_onnxruntime_training():
    require("onnx", "ONNX Runtime training export")
    ort = require("onnxruntime", "ONNX Runtime training")
    ort.set_default_logger_severity(3)  # its INFO log lists every graph transformer it applies
    require("onnxruntime.training.artifacts", "ONNX Runtime training (onnxruntime-training-cpu)")
    return ort


@contextlib.contextmanager
def _attention_without_gqa() -> Iterator[None]:
    """The TorchScript ONNX exporter cannot convert scaled_dot_product_attention with enable_gqa=True.
    While exporting, expand the key/value heads to the query heads instead (the same attention:
    grouped-query attention is that repetition) and call the original without the flag."""
    original = F.scaled_dot_product_attention

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
        if enable_gqa and key.shape[-3] != query.shape[-3]:
            groups = query.shape[-3] // key.shape[-3]
            key = key.repeat_interleave(groups, dim=-3)
            value = value.repeat_interleave(groups, dim=-3)
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale)

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def to_onnx(model: nn.Module, batch: Batch):
    """The loss-inside ONNX model (an onnx.ModelProto) for batches shaped like `batch`."""
    _require_onnxruntime_training()
    import onnx

    buffer = io.BytesIO()
    was_training = model.training
    model.train()
    try:
        with _attention_without_gqa(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(LossModule(model), (batch.inputs, batch.targets), buffer, dynamo=False,
                              input_names=["inputs", "targets"], output_names=["loss"], opset_version=OPSET,
                              do_constant_folding=False, export_params=True,
                              training=torch.onnx.TrainingMode.TRAINING)
    except Exception as exc:  # the exporter raises UnsupportedOperatorError, SymbolicValueError, ...
        raise ExportError(f"torch.onnx could not export {type(model).__name__} for inputs "
                          f"{tuple(batch.inputs.shape)}: {type(exc).__name__}: {exc}") from exc
    finally:
        model.train(was_training)
    return onnx.load_from_string(buffer.getvalue())


def export_onnxruntime(model: nn.Module, batch: Batch, directory: str | Path) -> Path:
    """Write the ONNX Runtime training artifacts of `model` (trainable weights as set by requires_grad)."""
    _require_onnxruntime_training()
    from onnx import helper
    from onnxruntime.training import artifacts

    wanted = {WRAPPED_PREFIX + name for name in trainable_names(model)}
    onnx_model = to_onnx(model, batch)
    initializers = [init.name for init in onnx_model.graph.initializer]
    requires_grad = [name for name in initializers if name in wanted]
    missing = sorted(wanted - set(requires_grad))
    if missing:
        raise ExportError(f"trainable parameter(s) {', '.join(missing)} did not survive the ONNX export "
                          "as named initializers; cannot train them in ONNX Runtime")
    frozen = [name for name in initializers if name not in wanted]

    def fill(new: Path) -> None:
        try:
            with _quiet_stdout():
                artifacts.generate_artifacts(onnx_model, requires_grad=requires_grad, frozen_params=frozen,
                                             loss=None, optimizer=artifacts.OptimType.SGD,
                                             artifact_directory=str(new))
        except Exception as exc:  # e.g. "No gradient builder for op X"
            if says_disk_full(exc):  # the disk, not the graph: atomic_write_directory names it
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from None
            raise ExportError(f"ONNX Runtime could not build the training graph: {type(exc).__name__}: {exc}") from exc

    # The four artifacts must come from one export: built aside and swapped in as one step. Its checkpoint
    # holds every weight, so a disk without room for them is refused before the artifacts are built.
    weights = sum(math.prod(init.dims) * helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
                  for init in onnx_model.graph.initializer)
    return atomic_write_directory(directory, fill, needed=weights)


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """generate_artifacts prints its progress on the C-level stdout/stderr; keep it off the user's terminal
    unless EDGETRAIN_VERBOSE is set."""
    if os.environ.get("EDGETRAIN_VERBOSE"):
        yield
        return
    saved = [os.dup(1), os.dup(2)]
    with open(os.devnull, "wb") as null:
        os.dup2(null.fileno(), 1)
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


class OrtTrainer:
    """Trains generated artifacts with the ONNX Runtime training API (Module + SGD Optimizer).

        trainer = OrtTrainer("artifacts/", lr=0.1)
        loss = trainer.step(batch)
        weights = trainer.parameters()          # {model parameter name: tensor}
    """

    runtime = "ONNX Runtime"

    def __init__(self, directory: str | Path, lr: float, batch: Batch | None = None) -> None:
        _require_onnxruntime_training()
        from onnxruntime.training.api import CheckpointState, Module, Optimizer

        directory = readable_directory(directory)
        absent = [name for name in ARTIFACTS if not (directory / name).exists()]
        if absent:
            raise ExportError(f"{directory}: not ONNX Runtime training artifacts (missing {', '.join(absent)})")
        self.state = CheckpointState.load_checkpoint(str(directory / "checkpoint"))
        try:
            self._module = Module(str(directory / "training_model.onnx"), self.state,
                                  str(directory / "eval_model.onnx"))
        except Exception as exc:  # an op without a kernel in this build is reported here, by name
            raise ExportError(f"ONNX Runtime cannot load the training model: {exc}") from exc
        self._optimizer = Optimizer(str(directory / "optimizer_model.onnx"), self._module)
        self._optimizer.set_learning_rate(lr)
        self._module.train()
        self.signature = None if batch is None else BatchSignature.of(batch)
        self.steps_done = 0

    def step(self, batch: Batch) -> float:
        if self.signature is not None:
            self.signature.check(batch, self.runtime)
        try:
            loss = self._module(batch.inputs.contiguous().numpy(), batch.targets.contiguous().numpy())
        except Exception as exc:
            raise ExportError(f"ONNX Runtime refused batch {batch.index} (inputs {tuple(batch.inputs.shape)} "
                              f"{batch.inputs.dtype}): {exc}") from exc
        self._optimizer.step()
        self._module.lazy_reset_grad()
        self.steps_done += 1
        return float(loss)

    def parameters(self) -> dict[str, torch.Tensor]:
        named = {}
        for name, parameter in self.state.parameters:
            if parameter.requires_grad:
                named[name] = torch.from_numpy(parameter.data.copy())
        return strip_prefix(named)
