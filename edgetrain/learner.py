"""The streaming-learner interface: feed a batch, take a step, read stats.

    learner = Learner(model, method="mesp", backend="torch-cpu", optimizer="adamw", lr=1e-4)
    stats = learner.step(batch)          # StepStats: loss, tokens, seconds, peak memory
    loss, grads = learner.compute_gradients(batch)
    learner.fit(stream, max_steps=100, checkpoint_every=20, checkpoint_dir="ckpt")

Everything else (how a gradient is produced) belongs to the method; where memory is read belongs to
the probe; where tensors live belongs to the backend. The first-step memory-budget guard, the checkpoint
payload and the stream loop are their own modules (budget_guard, learner_state, fit_loop).
"""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable

import torch
from torch import nn

from edgetrain import backends as _backends  # noqa: F401  (registers backends)
from edgetrain import methods as _methods  # noqa: F401  (registers methods)
from edgetrain.backends import Backend, get_backend
from edgetrain.budget_guard import FALLBACK_ORDER  # noqa: F401  (re-exported: MLXLearner)
from edgetrain.budget_guard import (MemoryBudgetError, budget_message, first_step_within_budget, measure_undone_step,
                                    resolve_memory_budget)
from edgetrain.budget_report import StepFigure
from edgetrain.checkpoint import (CorruptCheckpointError, atomic_save_safetensors, check_counters, load_latest_good,
                                  load_safetensors_checked, metadata_json, rotating_checkpoint_paths, save_rotating,
                                  unflatten_optimizer_state)
from edgetrain.data.batch import Batch
from edgetrain.data.validate import batch_expectations, validate_batch
from edgetrain.finite_steps import FiniteOptimizerSteps
from edgetrain.fit_loop import fit_stream
from edgetrain.fit_loop import format_progress, stats_dict  # noqa: F401  (re-exported)
from edgetrain.learner_state import CHECKPOINT_FORMAT, apply_restored, checkpoint_payload
from edgetrain.logs import get_logger
from edgetrain.losses import task_loss
from edgetrain.memory_sizes import parse_bytes
from edgetrain.methods.base import METHODS, NonFiniteError, TrainingError, trainable_parameters
from edgetrain.optimizers import make_optimizer
from edgetrain.registry import EdgetrainError
from edgetrain.schedules import LRSchedule, check_learning_rate, check_same_schedule
from edgetrain.step_memory import StepMemory

log = get_logger(__name__)

__all__ = ["Learner", "MemoryBudgetError", "StepStats", "TrainingError", "parse_bytes"]


@dataclass
class StepStats:
    """What one step did and cost.

    peak_bytes: the memory the step added, read by `probe` (None without one): its peak during the step
    minus its reading just before, with the allocator's free heap given back to the kernel and its large
    free chunks plugged for the step (so a step cannot be served, unseen, from memory that is already
    resident), less the file-backed pages the step mapped in (memory-mapped weights read for the first
    time, library code), which are not step memory. The weights and whatever the process held before are
    not in it. So the same step reads the same in a long-lived process as in a fresh one after a warm-up
    step (within 1 MiB + 5%, tests/test_step_memory.py); the first step of a process adds its one-time
    allocations (thread pools, kernel caches). edgetrain/step_memory.py has the details.
    """

    step: int               # steps completed after this one
    loss: float
    samples: int
    tokens: int
    seconds: float
    peak_bytes: int | None  # the memory the step added (see above); None if no probe
    probe: str
    lr: float | None = None  # the learning rate this step used (the schedule's rate at this step)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


def _resolve_probe(probe: Any, backend: str):
    """None/False/a probe name/a probe object -> a working probe or None (with a message saying why)."""
    if probe is False:
        return None
    from edgetrain.probes import PROBES, default_probe_name

    if probe is None or isinstance(probe, str):
        probe = PROBES.get(probe or default_probe_name(backend))()
    ok, reason = probe.available()
    if not ok:
        log.warning("memory probe %r unavailable (%s); peak memory not reported", probe.name, reason)
        return None
    prepare = getattr(probe, "prepare_process", None)
    if callable(prepare):
        prepare()  # what the probe needs of this process before the model is measured (LinuxProbe)
    return probe


class Learner:
    framework: ClassVar[str] = "torch"  # the models it drives: its backend's framework must be this

    def __new__(cls, *args: Any, **kwargs: Any) -> "Learner":
        # Learner(model, backend="mlx", ...) is the learner its backend names (MLXLearner: same interface,
        # MLX models).
        if cls is Learner:
            backend = kwargs.get("backend", args[2] if len(args) > 2 else "torch-cpu")
            if isinstance(backend, str) and backend in _backends.BACKENDS:
                entry = _backends.BACKENDS.get(backend)
                if entry.learner != Backend.learner:
                    cls = entry.require().learner_class()  # says why not (mlx missing) before importing it
        return super().__new__(cls)

    def __init__(self, model: nn.Module, method: str = "bp", backend: str = "torch-cpu",
                 optimizer: str | Callable = "sgd", lr: float = 1e-3, *,
                 optimizer_options: dict[str, Any] | None = None,
                 method_options: dict[str, Any] | None = None,
                 probe: Any = None, seed: int | None = 0, memory_budget: int | str | None = None,
                 fallback_methods: Iterable[str] = (), target: str | None = None,
                 lr_schedule: str | None = None, schedule_options: dict[str, Any] | None = None) -> None:
        self.backend = get_backend(backend)
        lr = check_learning_rate(lr)
        self.lr_schedule = LRSchedule.make(lr_schedule, schedule_options)
        if self.backend.framework != self.framework:
            raise EdgetrainError(f"backend {backend!r} runs {self.backend.framework} models; "
                                 f"{type(self).__name__} drives {self.framework} models")
        if seed is not None:
            torch.manual_seed(seed)
        self.model = model.to(self.backend.device)
        self.model.train()
        self.method_name = method
        self.method_options = dict(method_options or {})
        self.method = METHODS.get(method)(self.model, **self.method_options)
        self.params = trainable_parameters(self.model)
        self.optimizer = make_optimizer(optimizer, list(self.params.values()), lr, **(optimizer_options or {}))
        # The schedule scales each group's own rate (a custom optimizer may set per-group rates).
        self.base_lrs = [check_learning_rate(group["lr"], "optimizer lr") for group in self.optimizer.param_groups]
        # Every optimizer step, also the per-block steps of fused methods, is all or nothing.
        self._finite_steps = FiniteOptimizerSteps(self.optimizer, self.params)
        self.memory_budget, self.memory_budget_origin = resolve_memory_budget(memory_budget, target)
        self.fallback_methods = tuple(fallback_methods)
        for name in self.fallback_methods:
            METHODS.get(name)
        self.probe = _resolve_probe(probe, self.backend.name)
        self._budget_probe = self.probe
        if self.memory_budget is not None and self.probe is None:
            if probe is not None:
                raise EdgetrainError("a memory budget needs a working memory probe to measure the first step")
            from edgetrain.probes import TensorAccountant

            # Without an OS probe, tensor accounting still sees every tensor torch allocates (not the
            # allocator's slack); good enough to refuse a step that cannot fit.
            log.warning("measuring the first step against the memory budget by tensor accounting")
            self._budget_probe = TensorAccountant(self.model)
        self._step_probe = self.probe
        self.steps_done = 0
        self.stream_position = 0
        # What the stream fed (IndexedStream.fingerprint), saved with each checkpoint; after a resume, the
        # checkpoint's, until fit has checked that the stream it is given is the same data.
        self.data_fingerprint: dict | None = None
        self._resumed_data: tuple[dict, str] | None = None
        self._budget_checked = self.memory_budget is None

    # -- one batch -----------------------------------------------------------------------------
    def _prepare(self, batch: Batch) -> Batch:
        if not isinstance(batch, Batch):
            raise EdgetrainError(f"expected an edgetrain Batch, got {type(batch).__name__}")
        validate_batch(batch, **batch_expectations(self.model))
        return batch.to(self.backend.device)

    @property
    def weights_bytes(self) -> int:
        tensors = {id(t): t for t in list(self.model.parameters()) + list(self.model.buffers())}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def _snapshot(self) -> tuple[dict[str, torch.Tensor], dict]:
        import copy

        return ({name: p.detach().clone() for name, p in self.params.items()},
                copy.deepcopy(self.optimizer.state_dict()))

    def _restore_snapshot(self, snapshot: tuple[dict[str, torch.Tensor], dict]) -> None:
        weights, optimizer_state = snapshot
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(weights[name])
        self.optimizer.load_state_dict(optimizer_state)

    def _side_state(self) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The torch RNG state and copies of the running statistics of normalisation layers in training
        mode (the buffers a forward updates); small next to the weights."""
        running = [(buffer, buffer.clone()) for module in self.model.modules()
                   if isinstance(module, nn.modules.batchnorm._NormBase) and module.training
                   for buffer in module.buffers(recurse=False)]
        return torch.get_rng_state(), running

    def _restore_side_state(self, side_state: tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        rng, running = side_state
        torch.set_rng_state(rng)
        with torch.no_grad():
            for buffer, kept in running:
                buffer.copy_(kept)

    def step(self, batch: Batch) -> StepStats:
        """One step. A NaN/inf loss or gradient raises TrainingError and leaves the weights (and
        optimizer state) of the last good step; the first step is checked against the memory budget."""
        batch = self._prepare(batch)
        if not self._budget_checked:
            return self._first_step_within_budget(batch)
        snapshot = self._snapshot() if getattr(self.method, "partial_updates", False) else None
        # What a forward changes besides the weights: a failed step puts it back, so that the state
        # (and a checkpoint written after the failure) is the state of the last good step.
        side_state = None if getattr(self.method, "advances_on_failure", False) else self._side_state()
        lr = self._apply_lr_schedule()
        probe = self._step_probe
        # What the step adds to the memory held before it (edgetrain/step_memory.py says how it is read).
        window = StepMemory(probe) if probe is not None else None
        try:
            with window if window is not None else nullcontext():
                self.backend.synchronize()
                start = time.perf_counter()
                loss = self.method.step(batch, self.optimizer)
                self.backend.synchronize()
                seconds = time.perf_counter() - start
        except Exception as exc:
            self._finite_steps.put_back_interrupted(self.optimizer)
            if snapshot is not None:
                self._restore_snapshot(snapshot)
            if side_state is not None:
                self._restore_side_state(side_state)
            self.optimizer.zero_grad(set_to_none=True)
            if not isinstance(exc, NonFiniteError):
                raise
            raise TrainingError(f"step {self.steps_done + 1} stopped on batch {batch.index}: {exc}; "
                                "the weights of the last good step are kept") from None
        peak = None if window is None else window.added_bytes
        loss_value = float(loss)
        if not math.isfinite(loss_value):
            raise TrainingError(f"non-finite loss {loss_value} at step {self.steps_done + 1} (batch {batch.index})")
        self.steps_done += 1
        self.stream_position = batch.index + 1
        return StepStats(step=self.steps_done, loss=loss_value, samples=batch.num_samples,
                         tokens=batch.num_tokens, seconds=seconds, peak_bytes=peak,
                         probe=probe.name if probe is not None else "none", lr=lr)

    def _apply_lr_schedule(self) -> float:
        """Set every group's rate for the coming step; returns the first group's."""
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = self.lr_schedule.rate(base, self.steps_done)
        return float(self.optimizer.param_groups[0]["lr"])

    def _first_step_within_budget(self, batch: Batch) -> StepStats:
        """Measure the first step against the memory budget (edgetrain/budget_guard.py says what is charged);
        over it, undo the step and fall back to an allowed method or raise MemoryBudgetError."""
        return first_step_within_budget(self, batch)

    def _measure_undone_step(self, batch: Batch) -> int | None:
        """What one step on `batch` adds, measured by the budget probe, then undone entirely."""
        return measure_undone_step(self, batch)

    def _budget_message(self, batch: Batch, probe_name: str, tried: list[StepFigure]) -> str:
        return budget_message(self, batch, probe_name, tried)

    def compute_gradients(self, batch: Batch) -> tuple[float, dict[str, torch.Tensor]]:
        """Loss and gradient (or the method's estimate) per trainable parameter; weights unchanged."""
        loss, grads = self.method.gradients(self._prepare(batch))
        return float(loss), grads

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch]) -> dict[str, float]:
        """Mean loss over the batches (weighted by tokens or samples), perplexity for language
        models, accuracy for classifiers."""
        self.model.eval()
        total_loss, total_weight, correct = 0.0, 0, 0
        try:
            for batch in batches:
                batch = self._prepare(batch)
                outputs = self.model(batch.inputs)
                weight = batch.num_tokens
                total_loss += float(task_loss(self.model, outputs, batch.targets)) * weight
                total_weight += weight
                if getattr(self.model, "task", "classify") == "classify":
                    correct += int((outputs.argmax(-1) == batch.targets).sum())
        finally:
            self.model.train()
        if total_weight == 0:
            raise EdgetrainError("evaluate() got no batches")
        metrics = {"loss": total_loss / total_weight}
        if getattr(self.model, "task", "classify") == "lm":
            metrics["perplexity"] = math.exp(min(metrics["loss"], 50.0))
        else:
            metrics["accuracy"] = correct / total_weight
        return metrics

    def finish(self) -> nn.Module:
        """End training: the method's own finish step where it has one (SegProp / lw remove their
        training-only adapters), then forget parameters the model no longer holds, so checkpoints
        written afterwards do not carry them. Returns the model."""
        method_finish = getattr(self.method, "finish", None)
        if callable(method_finish):
            method_finish()
        self._forget_parameters_not_in_model()
        return self.model

    def _forget_parameters_not_in_model(self) -> None:
        held = {id(p) for p in self.model.parameters()}
        self.params = {name: p for name, p in self.params.items() if id(p) in held}

    # -- checkpoints ---------------------------------------------------------------------------
    def _checkpoint_payload(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        return checkpoint_payload(self)

    def save(self, path: str | Path) -> Path:
        """Atomically write trainable weights, buffers, optimizer state, RNG, method seeds, counters.
        Frozen base weights are not written: they come from the base model."""
        tensors, metadata = self._checkpoint_payload()
        return atomic_save_safetensors(tensors, path, metadata)

    def load(self, path: str | Path) -> "Learner":
        tensors, metadata = load_safetensors_checked(path)
        self._restore(tensors, metadata, str(path))
        return self

    def save_rotating(self, directory: str | Path, keep: int = 2) -> Path:
        tensors, metadata = self._checkpoint_payload()
        return save_rotating(tensors, metadata, directory, self.steps_done, keep=keep)

    def resume(self, directory: str | Path) -> Path | None:
        """Load the newest good checkpoint in `directory` (None when there is none yet)."""
        if not rotating_checkpoint_paths(directory):
            return None
        # A checkpoint whose state cannot be restored (CorruptCheckpointError) is skipped like a damaged file.
        path, _, _ = load_latest_good(directory, warn=log.warning,
                                      restore=lambda p, tensors, metadata: self._restore(tensors, metadata, str(p)))
        return path

    def _use_method(self, name: str) -> None:
        self.method_name = name
        # The original method's options do not apply to another method.
        self.method_options = {}
        self.method = METHODS.get(name)(self.model)

    def _restore(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str], source: str) -> None:
        """Restore a checkpoint, all or nothing: everything is checked first, and if applying it still
        fails, the weights, optimizer state, RNG and method are put back as they were."""
        if metadata.get("format") != CHECKPOINT_FORMAT:
            raise EdgetrainError(f"{source} is not an edgetrain learner checkpoint")
        saved_method = metadata.get("method")
        # A run that fell back to a lower-memory method (fallback_methods) saved that method: resuming
        # continues with it, as the uninterrupted run would have.
        if saved_method != self.method_name and saved_method not in self.fallback_methods:
            raise EdgetrainError(f"{source} was written by method {saved_method!r}, "
                                 f"this learner runs {self.method_name!r}")
        state = metadata_json(metadata, "state", source, ("steps_done", "stream_position", "method", "optimizer"))
        check_same_schedule(state, self.lr_schedule, self.base_lrs, source)
        check_counters(state, source)
        for name, param in self.params.items():
            saved = tensors.get(f"param/{name}")
            if saved is None or saved.shape != param.shape:
                raise EdgetrainError(f"{source}: parameter {name!r} is missing or has the wrong shape")
        optimizer_state = unflatten_optimizer_state(tensors, state["optimizer"])
        before = (self._snapshot(), torch.get_rng_state(), self.method_name, self.method_options, self.method,
                  {name: b.clone() for name, b in self.model.named_buffers()})
        try:
            if saved_method != self.method_name:
                self._use_method(saved_method)
            self._apply_restored(tensors, state, optimizer_state, source)
        except BaseException as exc:
            snapshot, rng, self.method_name, self.method_options, self.method, buffers = before
            self._restore_snapshot(snapshot)
            torch.set_rng_state(rng)
            with torch.no_grad():
                for name, buffer in self.model.named_buffers():
                    buffer.copy_(buffers[name])
            if isinstance(exc, Exception) and not isinstance(exc, EdgetrainError):
                raise CorruptCheckpointError(f"{source}: its state does not fit this learner ({exc!r})") from exc
            raise

    def _apply_restored(self, tensors: dict[str, torch.Tensor], state: dict, optimizer_state: dict,
                        source: str) -> None:
        apply_restored(self, tensors, state, optimizer_state, source)

    # -- a stream ------------------------------------------------------------------------------
    def fit(self, stream: Iterable[Batch], max_steps: int, *, eval_every: int = 0,
            eval_batches: Callable[[], Iterable[Batch]] | None = None, checkpoint_every: int = 0,
            checkpoint_dir: str | Path | None = None, callbacks: Iterable[Callable] = (),
            progress: bool = False, log_every: int = 10, allow_data_change: bool = False) -> list[StepStats]:
        """Drive `stream` until `max_steps` steps are done in total (resumed steps count).

        Every `checkpoint_every` steps the learner is written atomically to `checkpoint_dir`;
        every `eval_every` steps `eval_batches()` is evaluated. Callbacks get (learner, stats).
        After a resume, a stream that feeds other data than the checkpoint was trained on is refused
        (DataChangedError) unless `allow_data_change` (then training goes on with the new data).
        Every `log_every` steps a progress line goes to the "edgetrain" logger at INFO; `progress` adds a
        bar on an interactive terminal."""
        return fit_stream(self, stream, max_steps, eval_every=eval_every, eval_batches=eval_batches,
                          checkpoint_every=checkpoint_every, checkpoint_dir=checkpoint_dir, callbacks=callbacks,
                          progress=progress, log_every=log_every, allow_data_change=allow_data_change)
