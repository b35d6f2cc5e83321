"""The streaming-learner interface: feed a batch, take a step, read stats.

    learner = Learner(model, method="mesp", backend="torch-cpu", optimizer="adamw", lr=1e-4)
    stats = learner.step(batch)          # StepStats: loss, tokens, seconds, peak memory
    loss, grads = learner.compute_gradients(batch)
    learner.fit(stream, max_steps=100, checkpoint_every=20, checkpoint_dir="ckpt")

Everything else (how a gradient is produced) belongs to the method; where memory is read belongs to
the probe; where tensors live belongs to the backend. Written once for every framework: what touches
tensors goes through the backend's Engine (edgetrain/training/engine.py: torch, MLX). The first-step memory-budget
guard and the stream loop are their own modules (budget_guard, fit_loop).
"""
from __future__ import annotations

import json
import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Iterable

from edgetrain import backends as _backends  # noqa: F401  (registers backends)
from edgetrain import methods as _methods  # noqa: F401  (registers methods)
from edgetrain.backends import get_backend
from edgetrain.backends.base import model_framework
from edgetrain.data.batch import Batch
from edgetrain.data.fingerprint import check_same_data
from edgetrain.methods.base import NonFiniteError, TrainingError
from edgetrain.registry import EdgetrainError
from edgetrain.training.budget_guard import (
    FALLBACK_ORDER,  # noqa: F401  (re-exported)
    MemoryBudgetError,
    first_step_within_budget,
    resolve_memory_budget,
)
from edgetrain.training.checkpoint import (
    CorruptCheckpointError,
    atomic_save_safetensors,
    check_counters,
    check_thread_runs,
    load_latest_good,
    load_safetensors_checked,
    metadata_json,
    rotating_checkpoint_paths,
    save_rotating,
)
from edgetrain.training.fit_loop import fit_stream, format_progress, stats_dict  # noqa: F401  (re-exported)
from edgetrain.training.gradient_steps import check_accumulation, check_gradient_step_method, micro_batches
from edgetrain.training.schedules import LRSchedule, check_learning_rate, check_same_schedule
from edgetrain.training.stats import StepStats
from edgetrain.training.threads import add_step, resume_note, thread_count, thread_fitter
from edgetrain.utils.logs import get_logger
from edgetrain.utils.memory_sizes import parse_bytes

log = get_logger(__name__)

__all__ = ["Learner", "MemoryBudgetError", "StepStats", "TrainingError", "parse_bytes"]


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
    """The streaming learner over one framework's Engine (the backend's: torch or MLX; the model must be of
    that framework). `accumulate=N` cuts each step's batch into N micro-batches and sums their gradients
    into one update (the whole batch's gradient, one micro-batch's activations); `max_grad_norm` clips
    that update's global L2 norm. Both need a method whose step is its gradient and one optimizer update
    (bp, mebp, mesp). `threads` sets torch's intra-op threads before every step: a number, or "auto" for
    the cores other processes left free, checked between steps (edgetrain.training.threads: beside a busy
    app, threads on a taken core stall the step); None leaves them as they are. Checkpoints record each
    step's count (thread_runs); a run that must resume to the bits of any other run keeps a fixed count."""

    def __init__(self, model: Any, method: str = "bp", backend: str = "torch-cpu",
                 optimizer: str | Callable = "sgd", lr: float = 1e-3, *,
                 optimizer_options: dict[str, Any] | None = None,
                 method_options: dict[str, Any] | None = None,
                 probe: Any = None, seed: int | None = 0, memory_budget: int | str | None = None,
                 fallback_methods: Iterable[str] = (), target: str | None = None,
                 lr_schedule: str | None = None, schedule_options: dict[str, Any] | None = None,
                 accumulate: int = 1, max_grad_norm: float | None = None,
                 threads: int | str | None = None) -> None:
        self.backend = get_backend(backend)
        self.threads = thread_fitter(threads)
        framework = model_framework(model)
        if framework != self.backend.framework:
            raise EdgetrainError(f"backend {backend!r} runs {self.backend.framework} models; this "
                                 f"{type(model).__name__} is a {framework} model")
        lr = check_learning_rate(lr)
        self.lr_schedule = LRSchedule.make(lr_schedule, schedule_options)
        self.accumulate, self.max_grad_norm = check_accumulation(accumulate, max_grad_norm)
        self.engine = self.backend.make_engine()
        self.methods = self.engine.methods
        self.seed = seed
        self.engine.seed(seed)
        self.model = self.engine.adopt(model)
        self.method_name = method
        self.method_options = dict(method_options or {})
        self.method = self.methods.get(method)(self.model, **self.method_options)
        if self.drives_gradients:
            check_gradient_step_method(self.method, method)
        self._params = self.engine.trainable(self.model)
        self.optimizer = self.engine.make_optimizer(optimizer, self.model, self._params, lr, optimizer_options or {})
        # The schedule scales each group's own rate (a custom optimizer may set per-group rates).
        self.base_lrs = [check_learning_rate(rate, "optimizer lr") for rate in self.engine.group_rates(self.optimizer)]
        self.memory_budget, self.memory_budget_origin = resolve_memory_budget(memory_budget, target)
        self.fallback_methods = tuple(fallback_methods)
        for name in self.fallback_methods:
            self.methods.get(name)
        self.probe = _resolve_probe(probe, self.backend.name)
        self.budget_probe = self.probe  # what measures steps against the memory budget
        if self.memory_budget is not None and self.probe is None:
            stand_in = None if probe is not None else self.engine.probe_without_os_probe(self.model)
            if stand_in is None:
                raise EdgetrainError("a memory budget needs a working memory probe to measure the first step")
            log.warning("measuring the first step against the memory budget by tensor accounting")
            self.budget_probe = stand_in
        self.steps_done = 0
        self.stream_position = 0
        # Each step's intra-op thread count as [count, steps] runs (edgetrain.training.threads.add_step),
        # saved with each checkpoint: with threads="auto" they are what a bit-for-bit match depends on.
        self.thread_runs: list[list] = []
        # What the stream fed (IndexedStream.fingerprint), saved with each checkpoint; after a resume, the
        # checkpoint's, until fit has checked that the stream it is given is the same data.
        self.data_fingerprint: dict | None = None
        self._resumed_data: tuple[dict, str] | None = None
        # Whether the first step has been measured against the memory budget (budget_guard).
        self.budget_checked = self.memory_budget is None

    @property
    def drives_gradients(self) -> bool:
        """Whether steps go through the method's gradients (accumulation or clipping) instead of its step."""
        return self.accumulate > 1 or self.max_grad_norm is not None

    @property
    def params(self) -> dict[str, Any]:
        """name -> trainable parameter."""
        return self.engine.live_parameters(self.model, self._params)

    # -- one batch -----------------------------------------------------------------------------
    def _prepare(self, batch: Batch) -> Any:
        if not isinstance(batch, Batch):
            raise EdgetrainError(f"expected an edgetrain Batch, got {type(batch).__name__}")
        return self.engine.prepare(batch, self.model)

    @property
    def weights_bytes(self) -> int:
        return self.engine.weights_bytes(self.model)

    def snapshot(self) -> Any:
        """The trainable weights and optimizer state, to put back with restore_snapshot."""
        return self.engine.snapshot(self.params, self.optimizer)

    def restore_snapshot(self, snapshot: Any) -> None:
        self.engine.restore_snapshot(self.model, self.params, self.optimizer, snapshot)

    def side_state(self) -> Any:
        """What a forward changes besides the weights (running statistics, ...), to put back with
        restore_side_state."""
        return self.engine.side_state(self.model)

    def restore_side_state(self, side_state: Any) -> None:
        self.engine.restore_side_state(side_state)

    def step(self, batch: Batch) -> StepStats:
        """One step. A NaN/inf loss or gradient raises TrainingError and leaves the weights (and
        optimizer state) of the last good step; the first step is checked against the memory budget
        (edgetrain/training/budget_guard.py: over it, the step is undone and an allowed lower-memory
        method is tried, or MemoryBudgetError is raised)."""
        prepared = self._prepare(batch)
        if not self.budget_checked:
            stats = first_step_within_budget(self, batch)
        else:
            stats = self._measured_step(batch, prepared, self.probe)
        # Here, not in _measured_step: the budget guard's undone tries are not steps of the run.
        add_step(self.thread_runs, stats.threads)
        return stats

    def step_measured_by(self, probe: Any, batch: Batch) -> StepStats:
        """One step past the memory-budget guard, its memory read by `probe` (the guard's measurements)."""
        return self._measured_step(batch, self._prepare(batch), probe)

    def _measured_step(self, batch: Batch, prepared: Any, probe: Any) -> StepStats:
        snapshot = self.snapshot() if getattr(self.method, "partial_updates", False) else None
        # What a forward changes besides the weights: a failed step puts it back, so that the state
        # (and a checkpoint written after the failure) is the state of the last good step.
        side_state = None if getattr(self.method, "advances_on_failure", False) else self.side_state()
        self.engine.begin_step(self.seed, self.steps_done)
        threads = self.fit_threads()
        lr = self._apply_lr_schedule()
        window = self.engine.step_window(probe) if probe is not None else None
        try:
            with window if window is not None else nullcontext():
                self.backend.synchronize()
                start = time.perf_counter()
                loss = self._update(batch, prepared)
                self.backend.synchronize()
                seconds = time.perf_counter() - start
        except Exception as exc:
            self.engine.after_failed_step(self.optimizer)
            if snapshot is not None:
                self.restore_snapshot(snapshot)
            if side_state is not None:
                self.restore_side_state(side_state)
            self.engine.clear_gradients(self.optimizer)
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
                         probe=probe.name if probe is not None else "none", lr=lr, threads=threads)

    def fit_threads(self) -> int | None:
        """The intra-op threads for this step (threads=): fixed, or fitted to the cores others left free
        (edgetrain.training.threads). None where the learner leaves them to the framework. Called before
        every step; other work on the learner's model (the personaliser's generation) calls it too."""
        if self.threads is None:
            return None
        count = thread_count(self.threads)
        if not self.engine.set_threads(count):
            # A count asked for and not given is worth a warning; "auto" asks for no more than such a
            # backend does anyway (edgetrain train passes it by default).
            report = log.warning if isinstance(self.threads, int) else log.info
            report("threads=%r: the %s backend sizes its own thread pool; left as it is",
                   self.threads if isinstance(self.threads, int) else "auto", self.backend.name)
            self.threads = None
            return None
        return count

    def _update(self, batch: Batch, prepared: Any) -> Any:
        """The step's work: the method's own step, or (accumulate / max_grad_norm) its gradients over the
        micro-batches, summed by their share of the batch's targets, and one optimizer update."""
        if not self.drives_gradients:
            return self.engine.run_step(self.method, prepared, self.optimizer)
        total, loss = None, 0.0
        slices = micro_batches(batch, self.accumulate) if self.accumulate > 1 else [(batch, 1.0)]
        for micro, share in slices:
            micro_loss, grads = self.engine.gradients(self.method, prepared if micro is batch
                                                      else self.engine.prepare(micro, self.model))
            loss += float(micro_loss) * share
            if not math.isfinite(loss):
                raise NonFiniteError(f"non-finite loss {loss} on a micro-batch")
            total = self.engine.add_gradients(total, grads, share)
            del grads
        # The update's global L2 norm before clipping (StepStats has no field for it).
        self.last_grad_norm = self.engine.apply_gradients(self.optimizer, self.params, total, self.max_grad_norm)
        return loss

    def _apply_lr_schedule(self) -> float:
        """Set every group's rate for the coming step; returns the first group's."""
        rates = [self.lr_schedule.rate(base, self.steps_done) for base in self.base_lrs]
        self.engine.set_group_rates(self.optimizer, rates)
        return float(self.engine.group_rates(self.optimizer)[0])

    def compute_gradients(self, batch: Batch) -> tuple[float, dict[str, Any]]:
        """Loss and gradient (or the method's estimate) per trainable parameter, in the framework's tensors
        (MLX arrays on MLX: np.array(g) converts); weights unchanged."""
        loss, grads = self.engine.gradients(self.method, self._prepare(batch))
        return float(loss), grads

    def evaluate(self, batches: Iterable[Batch]) -> dict[str, float]:
        """Mean loss over the batches (weighted by tokens or samples), perplexity for language
        models, accuracy for classifiers."""
        self.model.eval()
        try:
            return self.engine.evaluate(self.model, ((batch, self._prepare(batch)) for batch in batches))
        finally:
            self.model.train()

    def finish(self) -> Any:
        """End training: the method's own finish step where it has one (SegProp / lw remove their
        training-only adapters), then forget parameters the model no longer holds, so checkpoints
        written afterwards do not carry them. Returns the model."""
        method_finish = getattr(self.method, "finish", None)
        if callable(method_finish):
            method_finish()
        self._forget_parameters_not_in_model()
        return self.model

    def _forget_parameters_not_in_model(self) -> None:
        self._params = self.engine.held(self.model, self._params)

    # -- checkpoints ---------------------------------------------------------------------------
    def _checkpoint_payload(self) -> tuple[dict[str, Any], dict[str, str]]:
        tensors, extra_state = self.engine.checkpoint_tensors(self)
        metadata = {"format": self.engine.checkpoint_format, "method": self.method_name,
                    "state": json.dumps({"steps_done": self.steps_done, "stream_position": self.stream_position,
                                         "method": self.method.state_dict(), **extra_state,
                                         "lr_schedule": self.lr_schedule.to_dict(), "base_lrs": self.base_lrs,
                                         "data": self.data_fingerprint, "threads": self.thread_runs})}
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

    def checkpoint_bytes(self) -> int:
        """What a checkpoint of the learner as it is now takes on disk (its tensors and metadata; the safetensors
        header adds a few hundred bytes a tensor)."""
        tensors, metadata = self._checkpoint_payload()
        return (sum(t.numel() * t.element_size() for t in tensors.values() if hasattr(t, "numel"))
                + len(json.dumps(metadata)) + 256 * len(tensors))

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
        note = resume_note(self.thread_runs, self.threads)
        if note is not None:
            log.info("%s: %s", path, note)
        return path

    def use_method(self, name: str) -> None:
        """Train with method `name` from now on (a budget fallback, or the method a checkpoint was saved by)."""
        self.method_name = name
        # The original method's options do not apply to another method.
        self.method_options = {}
        self.method = self.methods.get(name)(self.model)

    def _restore(self, tensors: dict[str, Any], metadata: dict[str, str], source: str) -> None:
        """Restore a checkpoint, all or nothing: everything is checked first, and if applying it still
        fails, the weights, optimizer state, RNG and method are put back as they were."""
        if metadata.get("format") != self.engine.checkpoint_format:
            raise EdgetrainError(f"{source} is not an edgetrain {self.engine.checkpoint_kind} checkpoint")
        saved_method = metadata.get("method")
        # A run that fell back to a lower-memory method (fallback_methods) saved that method: resuming
        # continues with it, as the uninterrupted run would have.
        if saved_method != self.method_name and saved_method not in self.fallback_methods:
            raise EdgetrainError(f"{source} was written by method {saved_method!r}, "
                                 f"this learner runs {self.method_name!r}")
        state = metadata_json(metadata, "state", source, self.engine.state_keys)
        check_same_schedule(state, self.lr_schedule, self.base_lrs, source)
        check_counters(state, source)
        thread_runs = check_thread_runs(state, source)
        checked = self.engine.check_restore(self, tensors, state, source)
        before = (self.snapshot(), self.engine.restore_point(self), self.method_name, self.method_options,
                  self.method)
        try:
            if saved_method != self.method_name:
                self.use_method(saved_method)
            self.engine.apply_restore(self, tensors, state, checked)
            self.method.load_state_dict(state["method"])
        except BaseException as exc:
            snapshot, point, self.method_name, self.method_options, self.method = before
            self.restore_snapshot(snapshot)
            self.engine.roll_back_restore(self, point)
            # Everything that could be checked was: what still fails to apply is the file's content, and
            # resume falls back past it as past a damaged file.
            if isinstance(exc, Exception) and not isinstance(exc, CorruptCheckpointError):
                raise CorruptCheckpointError(f"{source}: its state does not fit this learner ({exc!r})") from exc
            raise
        self.steps_done, self.stream_position = state["steps_done"], state["stream_position"]
        self.thread_runs = [list(run) for run in thread_runs]
        data = state.get("data")
        self.data_fingerprint = data if isinstance(data, dict) else None
        self._resumed_data = (self.data_fingerprint, source) if self.data_fingerprint is not None else None

    # -- a stream ------------------------------------------------------------------------------
    def accept_stream(self, fingerprint: dict | None, allow_data_change: bool = False) -> None:
        """Take a stream about to be fed: after a resume, refuse one whose data is not what the checkpoint
        was trained on (DataChangedError) unless `allow_data_change`; then its fingerprint (None for a
        stream without one) is what the next checkpoints record."""
        if self._resumed_data is not None:
            saved, source = self._resumed_data
            check_same_data(saved, fingerprint, source, allow_data_change)
        self._resumed_data = None
        if fingerprint is not None:
            self.data_fingerprint = fingerprint

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
