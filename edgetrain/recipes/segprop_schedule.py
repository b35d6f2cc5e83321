"""`run_schedule`: a whole staged schedule over a data stream -- stage 1 (prefix + global head), each
segment in turn, then the adapters discarded -- with evaluation at every stage end and checkpoints
that resume exactly. `bp` (e2e) and `mebp` run through the same function as one stage, so the three
methods are compared on equal terms.

    result = run_schedule(model, digits_stream("train", image=True, shuffle=False, epochs=None),
                          "segprop", epochs_per_stage=10, lr=1e-3, optimizer="adamw",
                          eval_batches=test_batches, head_blocks=1, segments=3, snapcheck=True)
    result.final["accuracy"], [s.path_metrics for s in result.stages]

A stage lasts `epochs_per_stage` passes over the stream (`stream.batches_per_epoch` steps each), or
`steps_per_stage` steps, or less on a plateau (method options plateau_*). With `snapcheck=True` and
a stream in a fixed order (shuffle=False) batch ids repeat every epoch, so every epoch of a stage after
its first skips the frozen prefix. In a distributed run (edgetrain.recipes.ddp_segprop) `shard`
cuts each global batch to this rank's rows and `configure` installs the DDP hooks on the method.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn

from edgetrain.data.batch import Batch
from edgetrain.registry import EdgetrainError
from edgetrain.training.losses import task_loss
from edgetrain.utils.logs import get_logger
from edgetrain.utils.progress import progress_bar

log = get_logger(__name__)

STAGED_METHODS = ("segprop", "lw")


@dataclass
class StageReport:
    stage: int
    name: str
    steps: int
    mean_loss: float
    seconds: float
    path_metrics: dict[str, float] | None = None   # the stage's training path (adapter/aux) on eval data
    model_metrics: dict[str, float] | None = None  # the plain model forward on eval data


@dataclass
class ScheduleResult:
    model: nn.Module
    method: str
    stages: list[StageReport] = field(default_factory=list)
    final: dict[str, float] | None = None
    steps: int = 0
    seconds: float = 0.0
    snapcheck: dict[str, int] | None = None
    plan: str = ""
    losses: list[float] = field(default_factory=list)  # each step run by this call (rank mean under DDP)


def evaluate_outputs(model: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor],
                     batches: Iterable[Batch]) -> dict[str, float]:
    """Mean loss (and accuracy for classifiers) of `forward` over `batches`, weighted by samples/tokens."""
    total, weight, correct = 0.0, 0, 0
    device = next(model.parameters()).device
    with torch.no_grad():
        for batch in batches:
            batch = batch.to(device)
            outputs = forward(batch.inputs)
            count = batch.num_tokens
            total += float(task_loss(model, outputs, batch.targets)) * count
            weight += count
            if getattr(model, "task", "classify") == "classify":
                correct += int((outputs.argmax(-1) == batch.targets).sum())
    if weight == 0:
        raise EdgetrainError("evaluation got no batches")
    metrics = {"loss": total / weight}
    if getattr(model, "task", "classify") == "classify":
        metrics["accuracy"] = correct / weight
    return metrics


def _eval_batches(eval_batches: Any) -> list[Batch] | None:
    if eval_batches is None:
        return None
    return list(eval_batches() if callable(eval_batches) else eval_batches)


def run_schedule(model: nn.Module, stream: Any, method: str = "segprop", *, epochs_per_stage: float = 1,
                 steps_per_stage: int | list[int] | None = None, optimizer: str | Callable = "adamw",
                 lr: float = 1e-3, optimizer_options: dict[str, Any] | None = None, backend: str = "torch-cpu",
                 seed: int | None = 0, eval_batches: Any = None, checkpoint_dir: str | Path | None = None,
                 checkpoint_every: int = 0, write_checkpoints: bool = True, progress: bool = False,
                 shard: Callable[[Batch], Batch] | None = None,
                 configure: Callable[[Any], None] | None = None, finish: bool = True,
                 **method_options: Any) -> ScheduleResult:
    """Train `model` on `stream` with `method` through its whole schedule; see the module docstring.

    For `bp`/`mebp` the run is one stage of `epochs_per_stage` epochs (or `steps_per_stage` steps).
    `eval_batches` (a list, or a callable returning batches) is evaluated at every stage end: through
    the stage's training path and through the plain model; `result.final` is the plain model after
    `finish()` (adapters gone). Method options (head_blocks, segments, snapcheck, ...) pass through.
    """
    from edgetrain.training.learner import Learner

    staged = method in STAGED_METHODS
    per_epoch = getattr(stream, "batches_per_epoch", None)
    if steps_per_stage is None:
        if per_epoch is None:
            raise EdgetrainError("run_schedule: the stream has no batches_per_epoch; give steps_per_stage")
        steps_per_stage = max(1, math.ceil(epochs_per_stage * per_epoch))
    if staged:
        method_options["steps_per_stage"] = steps_per_stage
        if method_options.get("snapcheck") and method_options.get("snapcheck_period") is None:
            if getattr(stream, "shuffle", True) or per_epoch is None:
                log.warning("SnapCheck on a shuffled stream: batch ids never see the same batch twice, so the cache "
                            "only costs memory (use shuffle=False or snapcheck_period)")
            else:
                method_options["snapcheck_period"] = per_epoch
    elif method_options:
        raise EdgetrainError(f"run_schedule: {method} takes no method options; got {', '.join(sorted(method_options))}")
    learner = Learner(model, method=method, backend=backend, optimizer=optimizer, lr=lr,
                      optimizer_options=optimizer_options, method_options=method_options, probe=False, seed=seed)
    trainer = learner.method if staged else None
    if configure is not None:
        configure(learner.method)
    if trainer is not None:
        total_steps = trainer.total_budget
    else:
        total_steps = steps_per_stage if isinstance(steps_per_stage, int) else sum(steps_per_stage)
    if checkpoint_dir is not None:
        learner.resume(checkpoint_dir)
        if hasattr(stream, "start_index"):
            stream.start_index = learner.stream_position
    evals = _eval_batches(eval_batches)
    result = ScheduleResult(model=model, method=method, plan=trainer.plan.describe() if trainer else method)
    stage_losses: list[float] = []
    stage_started = time.perf_counter()
    started = stage_started

    def close_stage(index: int, name: str) -> None:
        nonlocal stage_losses, stage_started
        report = StageReport(index, name, len(stage_losses),
                             sum(stage_losses) / max(1, len(stage_losses)), time.perf_counter() - stage_started)
        if evals is not None:
            if trainer is not None:
                report.path_metrics = evaluate_outputs(model, partial_path(trainer, index), evals)
            report.model_metrics = evaluate_outputs(model, _plain_forward(model), evals)
        result.stages.append(report)
        extra = "" if report.path_metrics is None else \
            "  " + ", ".join(f"path {k} {v:.4g}" for k, v in report.path_metrics.items())
        log.info("%s stage %d (%s): %d steps, mean loss %.4f%s", method, index, name, report.steps, report.mean_loss,
                 extra)
        stage_losses = []
        stage_started = time.perf_counter()

    iterator = iter(stream)
    with progress_bar(total_steps, initial=min(learner.steps_done, total_steps), description=method,
                      enabled=progress) as bar:
        while learner.steps_done < total_steps:
            try:
                batch = next(iterator)
            except StopIteration:
                raise EdgetrainError(f"run_schedule: the stream ended after {learner.steps_done} of {total_steps} "
                                     "steps; give it more epochs (or epochs=None)") from None
            stage_before = trainer.stage_index if trainer is not None else 0
            name = trainer.stage.name if trainer is not None else method
            stats = learner.step(shard(batch) if shard is not None else batch)
            bar.update()
            stage_losses.append(stats.loss)
            result.losses.append(stats.loss)
            if checkpoint_dir is not None and checkpoint_every and write_checkpoints \
                    and learner.steps_done % checkpoint_every == 0:
                learner.save_rotating(checkpoint_dir)
            if trainer is not None and (trainer.stage_index != stage_before or trainer.finished):
                close_stage(stage_before, name)
                if trainer.finished:
                    break
    if trainer is None and stage_losses:
        close_stage(0, method)
    result.steps = learner.steps_done
    result.seconds = time.perf_counter() - started
    if trainer is not None:
        if trainer.snapcheck is not None:
            result.snapcheck = trainer.snapcheck.stats()
        if finish:
            learner.finish()
    if evals is not None:
        result.final = evaluate_outputs(model, _plain_forward(model), evals)
    result.learner = learner  # type: ignore[attr-defined]
    return result


def partial_path(trainer: Any, stage: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda inputs: trainer.path_forward(inputs, stage)


def _plain_forward(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(inputs: torch.Tensor) -> torch.Tensor:
        was_training = model.training
        model.eval()
        try:
            return model(inputs)
        finally:
            model.train(was_training)
    return forward
