"""The stream loop behind Learner.fit: check the options, hand the stream to the learner (which refuses a
resumed run's changed data), step through the stream until the step count is reached, and log,
evaluate, checkpoint and call back on schedule. One plain function over the learner's public surface
(FittedLearner below), so learner.py keeps the per-step interface; format_progress and stats_dict are
the loop's log line and record.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol

from edgetrain.data.batch import Batch
from edgetrain.registry import EdgetrainError
from edgetrain.files.space import check_free_space
from edgetrain.training.checkpoint import ensure_writable_directory, rotating_checkpoint_paths
from edgetrain.training.stats import StepStats
from edgetrain.utils.logs import get_logger
from edgetrain.utils.progress import progress_bar

# The learner's own logger: progress lines read as the learner's, as they did before the move.
log = get_logger("edgetrain.training.learner")


class FittedLearner(Protocol):
    """What the loop reads and calls on the learner it drives (edgetrain.Learner)."""

    steps_done: int
    method_name: str

    def accept_stream(self, fingerprint: dict | None, allow_data_change: bool = False) -> None: ...
    def step(self, batch: Batch) -> StepStats: ...
    def evaluate(self, batches: Iterable[Batch]) -> dict[str, float]: ...
    def save_rotating(self, directory: str | Path, keep: int = 2) -> Path: ...
    def checkpoint_bytes(self) -> int: ...


KEPT_CHECKPOINTS = 2  # save_rotating's keep: the newest two stay, a third is written before the oldest goes


def check_checkpoint_room(learner: FittedLearner, directory: str | Path, every: int) -> None:
    """Refuse a run whose rotating checkpoints cannot fit on their disk, before the next one is due
    (DiskFullError naming it, the bytes and the free space). The rotation holds KEPT_CHECKPOINTS and writes
    one more before dropping the oldest; the ones already there count as written."""
    present = len(rotating_checkpoint_paths(directory))
    size = learner.checkpoint_bytes()
    needed = size * max(1, KEPT_CHECKPOINTS + 1 - present)
    due = max(-(-learner.steps_done // every) * every, every)
    check_free_space(Path(directory) / f"step-{due:08d}.safetensors", needed,
                     f"the rotating checkpoints ({KEPT_CHECKPOINTS + 1} at most at once, {size:,} bytes each), "
                     "starting with")


def fit_stream(learner: FittedLearner, stream: Iterable[Batch], max_steps: int, *, eval_every: int = 0,
               eval_batches: Callable[[], Iterable[Batch]] | None = None, checkpoint_every: int = 0,
               checkpoint_dir: str | Path | None = None, callbacks: Iterable[Callable] = (),
               progress: bool = False, log_every: int = 10, allow_data_change: bool = False) -> list[StepStats]:
    """Learner.fit (its docstring says what each option does), for `learner`."""
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
        # A lower bound here (an optimizer's state comes with the first step); exact after the run's first step.
        check_checkpoint_room(learner, checkpoint_dir, checkpoint_every)
    if eval_every and eval_batches is None:
        raise EdgetrainError("fit: eval_every needs eval_batches")
    fingerprint = stream.fingerprint() if callable(getattr(stream, "fingerprint", None)) else None
    learner.accept_stream(fingerprint, allow_data_change)
    history: list[StepStats] = []
    iterator: Iterator[Batch] = iter(stream)
    with progress_bar(max_steps, initial=min(learner.steps_done, max_steps), description=f"fit {learner.method_name}",
                      enabled=progress) as bar:
        while learner.steps_done < max_steps:
            try:
                batch = next(iterator)
            except StopIteration:
                break
            stats = learner.step(batch)
            history.append(stats)
            if checkpoint_dir is not None and len(history) == 1:  # the checkpoint's size is now what it stays
                check_checkpoint_room(learner, checkpoint_dir, checkpoint_every)
            bar.update()
            bar.set_postfix_str(f"loss {stats.loss:.4f}", refresh=False)
            for callback in callbacks:
                callback(learner, stats)
            if log_every and (stats.step % log_every == 0 or stats.step == max_steps):
                log.info(format_progress(stats, max_steps))
            if eval_every and stats.step % eval_every == 0:
                metrics = learner.evaluate(eval_batches())
                log.info("eval at step %d: %s", stats.step, ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
            if checkpoint_every and stats.step % checkpoint_every == 0:
                learner.save_rotating(checkpoint_dir, keep=KEPT_CHECKPOINTS)
    return history


def format_progress(stats: StepStats, max_steps: int) -> str:
    peak = "n/a" if stats.peak_bytes is None else f"{stats.peak_bytes / 2**20:.1f} MiB"
    return (f"step {stats.step}/{max_steps}  loss {stats.loss:.4f}  "
            f"{stats.tokens_per_second:,.0f} tok/s  peak {peak} ({stats.probe})")


def stats_dict(stats: StepStats) -> dict[str, Any]:
    return asdict(stats)
