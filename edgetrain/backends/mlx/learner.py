"""MLXLearner: the streaming-learner interface of edgetrain.learner.Learner for MLX decoders.

    learner = MLXLearner(model, method="mesp", optimizer="adamw", lr=1e-4)
    stats = learner.step(batch)          # StepStats: loss, tokens, seconds, peak memory (MLX probe)
    loss, grads = learner.compute_gradients(batch)   # grads: {name: mx.array} (np.array(g) converts)
    learner.fit(stream, max_steps=100, checkpoint_every=20, checkpoint_dir="ckpt")

Batches are edgetrain Batches (torch tensors, as every stream yields); they are validated as the
torch learner does and converted to MLX arrays. Checkpoints use edgetrain.checkpoint's atomic,
checksummed safetensors files.
"""
from __future__ import annotations

import copy
import json
import math
import time
from typing import Any, Iterable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from edgetrain.backends.mlx.loading import to_numpy
from edgetrain.backends.mlx.lora import set_parameters, trainable_parameters
from edgetrain.backends.mlx.methods import MLX_METHODS, lm_loss
from edgetrain.backends.mlx.optim import FlatOptimizer
from edgetrain.checkpoint import CorruptCheckpointError, check_counters, metadata_json
from edgetrain.data.batch import Batch
from edgetrain.data.validate import validate_batch
from edgetrain.learner import (FALLBACK_ORDER, Learner, MemoryBudgetError, StepStats, _resolve_probe,
                               resolve_memory_budget)
from edgetrain.logs import get_logger
from edgetrain.memory_estimate import first_slice_over_budget
from edgetrain.methods.base import NonFiniteError, TrainingError
from edgetrain.registry import EdgetrainError
from edgetrain.schedules import LRSchedule, check_learning_rate, check_same_schedule

log = get_logger(__name__)
CHECKPOINT_FORMAT = "edgetrain-mlx-learner-1"


def batch_arrays(batch: Batch) -> tuple[mx.array, mx.array]:
    """A Batch's token ids and targets as int32 MLX arrays (ids < 2^31: any real vocabulary)."""
    return (mx.array(batch.inputs.cpu().numpy().astype(np.int32)),
            mx.array(batch.targets.cpu().numpy().astype(np.int32)))


def _as_torch(array: mx.array):
    import torch

    values = to_numpy(array)
    if values.dtype.kind == "u":  # the optimizer's uint64 step counter: torch takes int64
        values = values.astype(np.int64)
    return torch.from_numpy(values.copy())  # (np.ascontiguousarray would make a scalar 1-d)


def _flatten_state(state: dict) -> dict[str, mx.array]:
    """The optimizer state {param name: {"m": ..}, "step": ..} as {"<param name>/m": .., "step": ..}.
    (Not mlx.utils.tree_flatten: parameter names hold dots, which it would split on the way back.)"""
    flat = {}
    for name, value in state.items():
        if isinstance(value, dict):
            flat.update({f"{name}/{key}": inner for key, inner in value.items()})
        else:
            flat[name] = value
    return flat


def _unflatten_state(flat: dict[str, mx.array]) -> dict:
    state: dict = {}
    for name, value in flat.items():
        if "/" in name:
            param, key = name.rsplit("/", 1)
            state.setdefault(param, {})[key] = value
        else:
            state[name] = value
    return state


class MLXLearner(Learner):
    """Same interface as edgetrain.Learner (step, compute_gradients, evaluate, save/load,
    save_rotating/resume, fit), for MLX models; `backend` must name an MLX backend ("mlx").
    edgetrain.Learner(model, backend="mlx", ...) constructs one. Stepping, evaluation and what a
    checkpoint holds (`_checkpoint_payload` / `_restore`) are MLX's own; the stream loop (`fit`) and the
    checkpoint files (`save`, `load`, `save_rotating`, `resume`) are Learner's, through those hooks."""

    framework = "mlx"

    def __init__(self, model: nn.Module, method: str = "bp", backend: str = "mlx",
                 optimizer: str | Any = "sgd", lr: float = 1e-3, *,
                 optimizer_options: dict[str, Any] | None = None, method_options: dict[str, Any] | None = None,
                 probe: Any = None, seed: int | None = 0, memory_budget: int | str | None = None,
                 fallback_methods: Iterable[str] = (), target: str | None = None,
                 lr_schedule: str | None = None, schedule_options: dict[str, Any] | None = None) -> None:
        from edgetrain.backends.base import BACKENDS

        self.backend = BACKENDS.get(backend).require()
        if self.backend.framework != self.framework:
            raise EdgetrainError(f"backend {backend!r} runs {self.backend.framework} models; MLXLearner drives MLX")
        self.seed = seed
        if seed is not None:
            mx.random.seed(seed)
        self.model = model
        self.model.train()
        self.method_name = method
        self.method_options = dict(method_options or {})
        self.method = MLX_METHODS.get(method)(self.model, **self.method_options)
        self.lr_schedule = LRSchedule.make(lr_schedule, schedule_options)
        self.optimizer = FlatOptimizer(model, optimizer, check_learning_rate(lr), **(optimizer_options or {}))
        self.base_lrs = [check_learning_rate(self.optimizer.learning_rate, "optimizer lr")]
        self.memory_budget, self.memory_budget_origin = resolve_memory_budget(memory_budget, target)
        self.fallback_methods = tuple(fallback_methods)
        for name in self.fallback_methods:
            MLX_METHODS.get(name)
        self.probe = _resolve_probe(probe, "mlx")
        if self.memory_budget is not None and self.probe is None:
            raise EdgetrainError("a memory budget needs a working memory probe to measure the first step")
        self.steps_done = 0
        self.stream_position = 0
        # What the stream fed (IndexedStream.fingerprint), saved with each checkpoint; after a resume, the
        # checkpoint's, until fit has checked that the stream it is given is the same data.
        self.data_fingerprint: dict | None = None
        self._resumed_data: tuple[dict, str] | None = None
        self._budget_checked = self.memory_budget is None

    @property
    def params(self) -> dict[str, mx.array]:
        return trainable_parameters(self.model)

    def _forget_parameters_not_in_model(self) -> None:
        pass  # `params` is read from the model every time

    @property
    def weights_bytes(self) -> int:
        return sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))

    def _prepare(self, batch: Batch) -> tuple[mx.array, mx.array]:
        if not isinstance(batch, Batch):
            raise EdgetrainError(f"expected an edgetrain Batch, got {type(batch).__name__}")
        validate_batch(batch, task="lm", vocab_size=self.model.config.vocab_size, num_classes=None)
        return batch_arrays(batch)

    def _snapshot(self) -> tuple[dict[str, mx.array], Any]:
        # Arrays are immutable: holding the current ones is the copy.
        return dict(self.params), self.optimizer.state_snapshot()

    def _restore_snapshot(self, snapshot: tuple[dict[str, mx.array], Any]) -> None:
        set_parameters(self.model, snapshot[0])
        self.optimizer.restore_snapshot(snapshot[1])

    def step(self, batch: Batch) -> StepStats:
        """One step. A NaN/inf loss or gradient raises TrainingError and leaves the weights (and
        optimizer state) of the last good step; the first step is checked against the memory budget."""
        inputs, targets = self._prepare(batch)
        if not self._budget_checked:
            return self._first_step_within_budget(batch)
        snapshot = self._snapshot() if getattr(self.method, "partial_updates", False) else None
        if self.seed is not None:
            # Randomness (LoRA dropout) as a pure function of (seed, step): resuming needs no RNG state.
            mx.random.seed((self.seed * 1_000_003 + self.steps_done) % 2**32)
        mx.eval(inputs, targets)
        lr = self.lr_schedule.rate(self.base_lrs[0], self.steps_done)
        self.optimizer.optimizer.learning_rate = lr
        baseline = None
        if self.probe is not None:
            self.probe.reset_peak()
            baseline = self.probe.current_bytes()
        self.backend.synchronize()
        start = time.perf_counter()
        try:
            loss = self.method.step(inputs, targets, self.optimizer)
            mx.eval(loss)
        except NonFiniteError as exc:
            if snapshot is not None:
                self._restore_snapshot(snapshot)
            raise TrainingError(f"step {self.steps_done + 1} stopped on batch {batch.index}: {exc}; "
                                "the weights of the last good step are kept") from None
        self.backend.synchronize()
        seconds = time.perf_counter() - start
        peak = None if self.probe is None else max(0, self.probe.peak_bytes() - baseline)
        loss_value = float(loss)
        if not math.isfinite(loss_value):
            raise TrainingError(f"non-finite loss {loss_value} at step {self.steps_done + 1} (batch {batch.index})")
        self.steps_done += 1
        self.stream_position = batch.index + 1
        return StepStats(step=self.steps_done, loss=loss_value, samples=batch.num_samples,
                         tokens=batch.num_tokens, seconds=seconds, peak_bytes=peak,
                         probe=self.probe.name if self.probe else "none", lr=lr)

    def _measure_undone_step(self, batch: Batch) -> int | None:
        """As Learner: the peak of one step on `batch`, then undone (weights, optimizer and method state,
        counters); randomness is a function of (seed, step), so it needs no undoing."""
        snapshot, method_state = self._snapshot(), copy.deepcopy(self.method.state_dict())
        counters = (self.steps_done, self.stream_position)
        self._budget_checked = True
        try:
            return self.step(batch).peak_bytes
        except EdgetrainError:
            return None
        finally:
            self._budget_checked = False
            self._restore_snapshot(snapshot)
            self.method.load_state_dict(method_state)
            self.steps_done, self.stream_position = counters

    def _first_step_within_budget(self, batch: Batch) -> StepStats:
        """As Learner: measure the first step; over budget, undo it and fall back or refuse."""
        tried: list[str] = []
        while True:
            over = first_slice_over_budget(self._measure_undone_step, batch, self.weights_bytes,
                                           self.memory_budget)
            if over is not None:
                tried.append(over.describe(self.method_name))
            else:
                snapshot = self._snapshot()
                self._budget_checked = True
                stats = self.step(batch)
                needed = self.weights_bytes + (stats.peak_bytes or 0)
                if needed <= self.memory_budget:
                    return stats
                self._restore_snapshot(snapshot)
                self.steps_done -= 1
                tried.append(f"{self.method_name}: {needed / 2**20:,.1f} MiB")
            done = [t.split(":")[0] for t in tried]
            candidates = [m for m in self.fallback_methods if m not in done]
            if not candidates:
                lower = [m for m in FALLBACK_ORDER if m in MLX_METHODS and m not in done]
                hint = f"a lower-memory method ({', '.join(lower)}; allow it with fallback_methods=)" if lower \
                    else "a smaller model"
                raise MemoryBudgetError(f"the first step needs {'; '.join(tried)} (weights "
                                        f"{self.weights_bytes / 2**20:,.1f} MiB + training peak measured by the "
                                        f"{self.probe.name} probe), over the memory budget of "
                                        f"{self.memory_budget / 2**20:,.1f} MiB{self.memory_budget_origin}. Try {hint}, a shorter "
                                        "sequence or a smaller LoRA rank")
            self.method_name, self.method_options = candidates[0], {}
            self.method = MLX_METHODS.get(self.method_name)(self.model)
            log.warning("%s is over the %s MiB budget; falling back to %s", tried[-1],
                        f"{self.memory_budget / 2**20:,.1f}", self.method_name)
            self._budget_checked = False

    def compute_gradients(self, batch: Batch) -> tuple[float, dict[str, mx.array]]:
        """Loss and gradient (or the method's estimate) per trainable parameter as MLX arrays
        (np.array(g) gives numpy); weights unchanged."""
        loss, grads = self.method.gradients(*self._prepare(batch))
        return float(loss), grads

    def evaluate(self, batches: Iterable[Batch]) -> dict[str, float]:
        """Mean loss over the batches (weighted by tokens) and perplexity."""
        self.model.eval()
        total_loss, total_weight = 0.0, 0
        try:
            for batch in batches:
                inputs, targets = self._prepare(batch)
                loss = lm_loss(self.model(inputs), targets)
                total_loss += float(loss) * batch.num_tokens
                total_weight += batch.num_tokens
        finally:
            self.model.train()
        if total_weight == 0:
            raise EdgetrainError("evaluate() got no batches")
        metrics = {"loss": total_loss / total_weight}
        metrics["perplexity"] = math.exp(min(metrics["loss"], 50.0))
        return metrics

    # -- checkpoints ---------------------------------------------------------------------------
    def _checkpoint_payload(self) -> tuple[dict[str, Any], dict[str, str]]:
        # No RNG state: each step reseeds MLX's generator from (seed, step), so a resumed run draws the
        # same. Frozen base weights are not written: they come from the base model.
        tensors = {f"param/{name}": _as_torch(p) for name, p in self.params.items()}
        tensors.update({f"optimizer/{name}": _as_torch(value)
                        for name, value in _flatten_state(self.optimizer.optimizer.state).items()})
        metadata = {"format": CHECKPOINT_FORMAT, "method": self.method_name,
                    "state": json.dumps({"steps_done": self.steps_done, "stream_position": self.stream_position,
                                         "method": self.method.state_dict(),
                                         "lr_schedule": self.lr_schedule.to_dict(), "base_lrs": self.base_lrs,
                                         "data": self.data_fingerprint})}
        return tensors, metadata

    def _restore(self, tensors: dict[str, Any], metadata: dict[str, str], source: str) -> None:
        """Restore a checkpoint, all or nothing (everything is checked before anything is set)."""
        if metadata.get("format") != CHECKPOINT_FORMAT:
            raise EdgetrainError(f"{source} is not an edgetrain MLX learner checkpoint")
        saved_method = metadata.get("method")
        # A run that fell back to a lower-memory method saved that method: resuming continues with it.
        if saved_method != self.method_name and saved_method not in self.fallback_methods:
            raise EdgetrainError(f"{source} was written by method {saved_method!r}, "
                                 f"this learner runs {self.method_name!r}")
        state = metadata_json(metadata, "state", source, ("steps_done", "stream_position", "method"))
        check_same_schedule(state, self.lr_schedule, self.base_lrs, source)
        check_counters(state, source)
        restored = {}
        for name, param in self.params.items():
            saved = tensors.get(f"param/{name}")
            if saved is None or tuple(saved.shape) != tuple(param.shape):
                raise EdgetrainError(f"{source}: parameter {name!r} is missing or has the wrong shape")
            restored[name] = mx.array(saved.float().numpy()).astype(param.dtype)
        restored_state = {}
        for name, value in _flatten_state(self.optimizer.optimizer.state).items():
            saved = tensors.get(f"optimizer/{name}")
            if saved is None or tuple(saved.shape) != tuple(value.shape):
                raise EdgetrainError(f"{source}: optimizer state {name!r} is missing or has the wrong shape")
            restored_state[name] = mx.array(saved.numpy()).astype(value.dtype)
        before = (self._snapshot(), self.method_name, self.method_options, self.method)
        try:
            if saved_method != self.method_name:
                self.method_name, self.method_options = saved_method, {}
                self.method = MLX_METHODS.get(saved_method)(self.model)
            set_parameters(self.model, restored)
            self.optimizer.optimizer.state = _unflatten_state(restored_state)
            self.method.load_state_dict(state["method"])
        except BaseException as exc:
            snapshot, self.method_name, self.method_options, self.method = before
            self._restore_snapshot(snapshot)
            if isinstance(exc, Exception) and not isinstance(exc, EdgetrainError):
                raise CorruptCheckpointError(f"{source}: its state does not fit this learner ({exc!r})") from exc
            raise
        self.steps_done, self.stream_position = state["steps_done"], state["stream_position"]
        data = state.get("data")
        self.data_fingerprint = data if isinstance(data, dict) else None
        self._resumed_data = (self.data_fingerprint, source) if self.data_fingerprint is not None else None
        mx.eval(self.model.trainable_parameters(), self.optimizer.optimizer.state)
