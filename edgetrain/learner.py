"""The streaming-learner interface: feed a batch, take a step, read stats.

    learner = Learner(model, method="mesp", backend="torch-cpu", optimizer="adamw", lr=1e-4)
    stats = learner.step(batch)          # StepStats: loss, tokens, seconds, peak memory
    loss, grads = learner.compute_gradients(batch)
    learner.fit(stream, max_steps=100, checkpoint_every=20, checkpoint_dir="ckpt")

Everything else (how a gradient is produced) belongs to the method; where memory is read belongs to
the probe; where tensors live belongs to the backend.
"""
from __future__ import annotations

import copy
import json
import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Iterator

import torch
from torch import nn

from edgetrain import backends as _backends  # noqa: F401  (registers backends)
from edgetrain import methods as _methods  # noqa: F401  (registers methods)
from edgetrain.backends import Backend, get_backend
from edgetrain.checkpoint import (CorruptCheckpointError, atomic_save_safetensors, check_counters,
                                  ensure_writable_directory, flatten_optimizer_state, load_latest_good,
                                  load_safetensors_checked, metadata_json, rotating_checkpoint_paths,
                                  save_rotating, unflatten_optimizer_state)
from edgetrain.data.batch import Batch
from edgetrain.data.fingerprint import check_same_data
from edgetrain.data.validate import batch_expectations, validate_batch
from edgetrain.logs import get_logger
from edgetrain.losses import task_loss
from edgetrain.finite_steps import FiniteOptimizerSteps
from edgetrain.budget_report import StepFigure, lower_memory_methods, rank_methods, refusal_message
from edgetrain.memory_estimate import first_slice_over_budget
from edgetrain.memory_sizes import parse_bytes
from edgetrain.methods.base import METHODS, NonFiniteError, TrainingError, trainable_parameters
from edgetrain.optimizers import make_optimizer
from edgetrain.progress import progress_bar
from edgetrain.probes.base import settle_memory
from edgetrain.registry import EdgetrainError
from edgetrain.schedules import LRSchedule, check_learning_rate, check_same_schedule
from edgetrain.step_estimates import estimate_step_bytes
from edgetrain.step_memory import StepMemory

log = get_logger(__name__)

CHECKPOINT_FORMAT = "edgetrain-learner-1"
__all__ = ["Learner", "MemoryBudgetError", "StepStats", "TrainingError", "parse_bytes"]


class MemoryBudgetError(TrainingError):
    """The measured first step does not fit the memory budget."""


def resolve_memory_budget(memory_budget: int | str | None, target: str | None) -> tuple[int | None, str]:
    """(budget in bytes or None, where it came from for messages). An explicit `memory_budget` overrides
    the device profile's; the profile is still loaded, so an unknown target is an error either way."""
    profile = None
    if target is not None:
        from edgetrain.targets import load_target

        profile = load_target(target)
    if memory_budget is not None:
        return parse_bytes(memory_budget), ""
    if profile is not None:
        return profile.memory_budget_bytes, f" of target {profile.name!r}"
    return None, ""


# Lower-memory methods to fall back to, best first (exact gradients before estimates).
FALLBACK_ORDER = ("mebp", "mesp", "mezo")


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
    allocations (thread pools, kernel caches: 4-6 MiB for SmolLM2-135M). edgetrain/step_memory.py has
    the details and the figures.
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
        """Measure the first step; refuse it, undone, when the memory it adds does not fit what the budget
        leaves beside the weights (or switch to the next allowed method and measure again).

        What is charged. The budget is the device's allowance for one training process (a device
        profile's memory_budget_mib: "weights included, leaving room for the OS and the app"). Training
        holds two things in it: the weights, and what a step adds while it runs.
        - The weights are charged once, at their full size (parameters and buffers), however they are
          held: in the process's own memory, or memory-mapped from the checkpoint (safetensors), resident
          or not yet read. The first forward reads all of them, so a device that trains must hold them.
        - The step is charged what it adds above the memory held before it (StepStats.peak_bytes;
          edgetrain/step_memory.py). Pages the step maps in from the weights' file are not step memory:
          charging them too counted memory-mapped weights twice and refused a step that fits (SmolLM2-135M
          from safetensors: mesp "needed" 1,046 MiB against a 622 MiB budget, where weights 522 MiB + the
          30 MiB its step adds fit).
        - What the process held before the weights -- the interpreter, torch's libraries, allocator
          caches -- is not charged: it is the app's share of the device, the same whichever method runs,
          and charging it would make one budget mean different things in a notebook and in a lean script
          (and in the exported runtime a phone runs).
        So a step is refused when weights + what it adds > budget: when what it adds does not fit what
        the budget leaves beside the weights. The refusal ranks the methods by the memory their step adds
        (measured where they ran, estimated from the model's shape where not: edgetrain/step_estimates.py)."""
        tried: list[StepFigure] = []
        while True:
            over = first_slice_over_budget(self._measure_undone_step, batch, self.weights_bytes,
                                           self.memory_budget)
            if over is not None:
                tried.append(StepFigure(self.method_name, over.needed_bytes - self.weights_bytes, measured=True,
                                        slice_tokens=over.slice_tokens, batch_tokens=over.batch_tokens))
            else:
                snapshot = self._snapshot()
                self._budget_checked = True
                settle_memory()
                self._step_probe = self._budget_probe
                try:
                    stats = self.step(batch)
                finally:
                    self._step_probe = self.probe
                added = stats.peak_bytes or 0
                if self.weights_bytes + added <= self.memory_budget:
                    return stats
                self._restore_snapshot(snapshot)
                self.steps_done -= 1
                tried.append(StepFigure(self.method_name, added, measured=True))
            candidates = [m for m in self.fallback_methods if m not in {figure.method for figure in tried}]
            if not candidates:
                raise MemoryBudgetError(self._budget_message(batch, self._budget_probe.name, tried))
            self._use_method(candidates[0])
            log.warning("%s adds more than the %s MiB the budget leaves beside the weights; falling back to %s",
                        tried[-1].describe(), f"{max(0, self.memory_budget - self.weights_bytes) / 2**20:,.1f}",
                        self.method_name)
            self._budget_checked = False

    def _measure_undone_step(self, batch: Batch) -> int | None:
        """What one step on `batch` adds (StepStats.peak_bytes), measured by the budget probe, then undone
        entirely: weights, optimizer and method state, RNG, running statistics and counters are as before.
        None when the step cannot run on this batch (the full step will then say why)."""
        snapshot, side_state = self._snapshot(), self._side_state()
        method_state = copy.deepcopy(self.method.state_dict())
        counters = (self.steps_done, self.stream_position)
        self._budget_checked = True
        settle_memory()
        self._step_probe = self._budget_probe
        try:
            return self.step(batch).peak_bytes
        except EdgetrainError:
            return None
        finally:
            self._step_probe = self.probe
            self._budget_checked = False
            self._restore_snapshot(snapshot)
            self._restore_side_state(side_state)
            self.method.load_state_dict(method_state)
            self.steps_done, self.stream_position = counters
            self.optimizer.zero_grad(set_to_none=True)

    def _budget_message(self, batch: Batch, probe_name: str, tried: list[StepFigure]) -> str:
        candidates = {*FALLBACK_ORDER, "bp", *(figure.method for figure in tried)}
        estimates = {name: estimate_step_bytes(self.model, batch, name)
                     for name in sorted(candidates) if name in METHODS}
        ranked = rank_methods(tried, estimates)
        suggestions = []
        lower = lower_memory_methods(tried, ranked, FALLBACK_ORDER, METHODS.names())
        if lower:
            suggestions.append(f"a lower-memory method ({', '.join(lower)}; allow it with fallback_methods=)")
        if batch.inputs.dim() >= 2 and getattr(self.model, "task", None) == "lm":
            suggestions.append(f"a shorter sequence (now {batch.inputs.shape[1]})")
        if batch.num_samples > 1:
            suggestions.append(f"a smaller batch (now {batch.num_samples})")
        config = getattr(self.model, "lora_config", None)
        if config is not None:
            suggestions.append(f"a smaller LoRA rank (now {config.rank})")
        return refusal_message(tried, ranked, weights_bytes=self.weights_bytes, budget_bytes=self.memory_budget,
                               budget_origin=self.memory_budget_origin, probe_name=probe_name,
                               suggestions=suggestions)

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
        tensors = {f"param/{name}": p.detach() for name, p in self.params.items()}
        for name, buffer in self.model.named_buffers():
            tensors[f"buffer/{name}"] = buffer.detach()
        optimizer_tensors, optimizer_rest = flatten_optimizer_state(self.optimizer.state_dict())
        tensors.update(optimizer_tensors)
        tensors["rng/torch"] = torch.get_rng_state()
        metadata = {"format": CHECKPOINT_FORMAT, "method": self.method_name,
                    "state": json.dumps({"steps_done": self.steps_done,
                                         "stream_position": self.stream_position,
                                         "method": self.method.state_dict(),
                                         "optimizer": optimizer_rest,
                                         "lr_schedule": self.lr_schedule.to_dict(),
                                         "base_lrs": self.base_lrs,
                                         "data": self.data_fingerprint})}
        return tensors, metadata

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
        buffers = dict(self.model.named_buffers())
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(tensors[f"param/{name}"])
            for name, buffer in buffers.items():
                if f"buffer/{name}" in tensors:
                    buffer.copy_(tensors[f"buffer/{name}"])
        self.optimizer.load_state_dict(optimizer_state)
        torch.set_rng_state(tensors["rng/torch"])
        self.method.load_state_dict(state["method"])
        self.steps_done, self.stream_position = state["steps_done"], state["stream_position"]
        data = state.get("data")
        self.data_fingerprint = data if isinstance(data, dict) else None
        self._resumed_data = (self.data_fingerprint, source) if self.data_fingerprint is not None else None

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
        if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 0:
            raise EdgetrainError(f"fit: checkpoint_every must be a whole number of steps >= 0, got {checkpoint_every!r}")
        if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 0:
            raise EdgetrainError(f"fit: log_every must be a whole number of steps >= 0, got {log_every!r}")
        if checkpoint_every and checkpoint_dir is None:
            raise EdgetrainError("fit: checkpoint_every needs a checkpoint_dir")
        if checkpoint_dir is not None and not checkpoint_every:
            raise EdgetrainError(f"fit: checkpoint_dir {str(checkpoint_dir)!r} is given but checkpoint_every is 0, "
                                 "so no checkpoint would ever be written")
        if checkpoint_dir is not None:
            ensure_writable_directory(checkpoint_dir, "fit: checkpoint_dir")
        if eval_every and eval_batches is None:
            raise EdgetrainError("fit: eval_every needs eval_batches")
        fingerprint = stream.fingerprint() if callable(getattr(stream, "fingerprint", None)) else None
        if self._resumed_data is not None:
            saved, source = self._resumed_data
            check_same_data(saved, fingerprint, source, allow_data_change)
        self._resumed_data = None
        if fingerprint is not None:
            self.data_fingerprint = fingerprint
        history: list[StepStats] = []
        iterator: Iterator[Batch] = iter(stream)
        with progress_bar(max_steps, initial=min(self.steps_done, max_steps), description=f"fit {self.method_name}",
                          enabled=progress) as bar:
            while self.steps_done < max_steps:
                try:
                    batch = next(iterator)
                except StopIteration:
                    break
                stats = self.step(batch)
                history.append(stats)
                bar.update()
                bar.set_postfix_str(f"loss {stats.loss:.4f}", refresh=False)
                for callback in callbacks:
                    callback(self, stats)
                if log_every and (stats.step % log_every == 0 or stats.step == max_steps):
                    log.info(format_progress(stats, max_steps))
                if eval_every and stats.step % eval_every == 0:
                    metrics = self.evaluate(eval_batches())
                    log.info("eval at step %d: %s", stats.step, ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
                if checkpoint_every and stats.step % checkpoint_every == 0:
                    self.save_rotating(checkpoint_dir)
        return history


def format_progress(stats: StepStats, max_steps: int) -> str:
    peak = "n/a" if stats.peak_bytes is None else f"{stats.peak_bytes / 2**20:.1f} MiB"
    return (f"step {stats.step}/{max_steps}  loss {stats.loss:.4f}  "
            f"{stats.tokens_per_second:,.0f} tok/s  peak {peak} ({stats.probe})")


def stats_dict(stats: StepStats) -> dict[str, Any]:
    return asdict(stats)
