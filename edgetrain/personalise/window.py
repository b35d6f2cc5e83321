"""A Personaliser's training windows, from opening to the gate (edgetrain.personalise.personaliser has the
overview).

A window snapshots the examples that are not held out, and the retain set (edgetrain.personalise.retain:
made by the base model the first time, with the base's score on it); loads the version it starts from,
measures that start's held-out metric (the reference), takes `window_steps` steps (a `replay` fraction of
them on the retain set) with a checkpoint every `checkpoint_every`, and ends at the gate, which promotes the
candidate or rejects it: no better than its start on the user's held-out examples, or forgetting (its
retain score worse than the base's by more than `retain_margin`). Windows is the one object that holds the
open window; the run loop (edgetrain.personalise.runner) decides when it steps.
"""
from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

from edgetrain.files.atomic import make_directory
from edgetrain.personalise.errors import BadExampleError
from edgetrain.personalise.examples import example_from_body, is_held_out
from edgetrain.personalise.kinds import NotEnoughData, ReplaySampler, gate, write_snapshot
from edgetrain.personalise.retain import RetainSplit, digest_of, forgetting_advice, worsened_by
from edgetrain.personalise.run_result import RunResult
from edgetrain.personalise.store import Store
from edgetrain.registry import EdgetrainError
from edgetrain.training.fit_loop import check_checkpoint_room

WINDOW = "window"


class Interrupted(Exception):
    """pause() or stop() arrived during an evaluation: it is abandoned and done again later."""


@dataclass
class Window:
    state: dict[str, Any]
    learner: Any
    batches: Any
    eval_batches: list
    retain_batches: list | None = None  # the retain set's scored part (None: no forgetting guard)
    checkpointed_step: int = 0
    room_checked: bool = False  # whether its rotating checkpoints were checked to fit on the disk


def window_directory(directory: Path) -> Path:
    """Where the open window of the store in `directory` keeps its snapshots and checkpoints."""
    return directory / WINDOW


def discard_window_files(directory: Path, store: Store) -> None:
    shutil.rmtree(window_directory(directory), ignore_errors=True)
    store.set_meta("window", None)


class WindowOwner(Protocol):
    """What the windows read off the Personaliser that owns them: its store and its settings."""

    directory: Path
    store: Store
    versions: Any
    events: Any
    backend_name: str
    optimizer: str
    lr: float | None
    seed: int
    batch_size: int
    seq_len: int
    window_steps: int
    checkpoint_every: int
    keep_versions: int
    margin: float
    retain_margin: float | None  # the forgetting guard's (None: off)
    replay: float
    retain_set: Any  # edgetrain.personalise.retain.RetainSet
    memory_budget: Any
    threads: Any  # None, a fixed count or a ThreadFitter shared by every window's learner

    @property
    def bound(self) -> dict[str, Any] | None: ...
    def require_model(self) -> tuple[Any, Any]: ...


class Windows:
    """The windows `owner` trains, with the settings it has when each is opened (read off the Personaliser).
    `interrupted` says whether pause() or stop() arrived: an evaluation then raises Interrupted."""

    def __init__(self, owner: WindowOwner, interrupted: Callable[[], bool]) -> None:
        self.owner = owner
        self.interrupted = interrupted
        self.current: Window | None = None
        self.need_bytes: int | None = None  # the step's memory need, for the policy: measured, else estimated
        self.measured = False
        self.reported_skips: set[str] = set()
        self.data_version: int | None = None

    @property
    def directory(self) -> Path:
        return window_directory(self.owner.directory)

    def discard_files(self) -> None:
        discard_window_files(self.owner.directory, self.owner.store)

    def clean_up(self) -> None:
        """At the start of a run: drop version directories no row names, and the window files when no window
        is recorded (a crash between recording and deleting)."""
        self.owner.versions.remove_orphans()
        if self.owner.store.get_meta("window") is None:
            shutil.rmtree(self.directory, ignore_errors=True)

    def check_generation(self) -> None:
        """Abandon the open window when forget() or rollback() (in any process) invalidated it."""
        owner = self.owner
        version = owner.store.data_version()
        if version == self.data_version:
            return
        self.data_version = version
        if self.current is not None and owner.versions.generation() != self.current.state["generation"]:
            owner.events.emit("window_abandoned", window=self.current.state["number"],
                              reason="examples were forgotten or the promoted version changed")
            self.current = None
            self.discard_files()

    def learner(self, state: dict[str, Any]) -> Any:
        from edgetrain.training.learner import Learner

        owner = self.owner
        model, trainer = owner.require_model()
        lr = state["lr"]
        # Steps are measured (a memory probe costs time every step) only for the budget guard; the memory
        # policy otherwise uses edgetrain's estimate of the step (decoders).
        return Learner(model, method=state["method"], backend=owner.backend_name, optimizer=owner.optimizer, lr=lr,
                       seed=state["seed"], memory_budget=owner.memory_budget,
                       probe=None if owner.memory_budget is not None else False, threads=owner.threads)

    def load_start(self, start: int | None) -> None:
        owner = self.owner
        model, trainer = owner.require_model()
        if start is None:
            trainer.load(model, owner.directory / owner.bound["base"])
        else:
            trainer.load(model, owner.versions.path(owner.versions.get(start)))

    def default_lr(self, task: str) -> float:
        if self.owner.lr is not None:
            return self.owner.lr
        return 1e-3 if task == "lm" else 1e-2

    def open(self) -> None:
        """Resume the recorded window, or begin a new one (NotEnoughData when there is not enough to train on)."""
        owner = self.owner
        bound = owner.bound
        recorded = owner.store.get_meta("window")
        if recorded is not None:
            try:
                if self.resume(recorded):
                    return
            except (NotEnoughData, Interrupted):
                raise
            except EdgetrainError as exc:  # every checkpoint damaged, or one this learner cannot take
                owner.events.emit("window_abandoned", window=recorded.get("number"), reason=str(exc))
                self.current = None
                self.discard_files()
        model, trainer = owner.require_model()
        with owner.store.reading() as connection:
            generation = owner.versions.generation(connection)
            start = owner.versions.start(connection)
            high_water = owner.store.high_water(connection)
            rows = owner.store.rows(high_water, connection)
            number = int(owner.store.get_meta("windows", 0, connection)) + 1
        train, held_out, held_ids = [], [], []
        for _, example_id, _, body in rows:
            try:
                example = example_from_body(body)
            except BadExampleError as exc:
                self.skip(example_id, f"damaged in the store ({exc})")
                continue
            if is_held_out(example_id, bound["holdout_every"]):
                held_out.append(example)
                held_ids.append(example_id)
            else:
                train.append(example)
        train_records, skipped = trainer.records(model, train)
        held_records, held_skipped = trainer.records(model, held_out)
        for example_id, reason in skipped + held_skipped:
            self.skip(example_id, reason)
        skipped_ids = {example_id for example_id, _ in skipped}
        train_ids = [example.id for example in train if example.id not in skipped_ids]
        if not train_records:
            raise NotEnoughData(f"no training examples yet ({len(held_out)} held out)")
        if not held_records:
            raise NotEnoughData(f"no held-out examples yet to judge a candidate by (one in {bound['holdout_every']} "
                                f"is held out, chosen by id; {len(train_records)} training examples)")
        directory = self.directory
        shutil.rmtree(directory, ignore_errors=True)
        make_directory(directory, "the window directory")
        write_snapshot(train_records, directory / "train.jsonl")
        write_snapshot(held_records, directory / "held_out.jsonl")
        state = {"number": number, "start": None if start is None else start.version, "generation": generation,
                 "seed": owner.seed * 1_000_003 + number, "steps": owner.window_steps, "method": bound["method"],
                 "backend": owner.backend_name, "lr": self.default_lr(bound["kind"]["task"]),
                 "batch_size": owner.batch_size, "seq_len": owner.seq_len, "train": len(train_records),
                 "held_out": len(held_records), "train_ids": train_ids,
                 "held_out_digest": hashlib.sha256(",".join(sorted(held_ids)).encode()).hexdigest(),
                 "guarded": self.guarded, "replay": owner.replay}
        state["retain"] = self.open_retain(state) if self.guarded else None
        self.load_start(state["start"])
        window = self.build(state)
        state["reference"] = self.reference(window, state)
        with owner.store.transaction() as connection:
            if owner.versions.generation(connection) != generation:
                raise Interrupted()  # forgotten or rolled back meanwhile: begin again
            owner.store.set_meta("window", state, connection)
            owner.store.set_meta("windows", number, connection)
        self.current = window
        retain = state["retain"] or {}
        owner.events.emit("window", window=number, start=state["start"] if state["start"] is not None else "base",
                          train=state["train"], held_out=state["held_out"], metric=trainer.metric,
                          reference=state["reference"], retain_base=retain.get("base"),
                          retain_scored=retain.get("scored"), replayed=retain.get("replayed"))

    @property
    def guarded(self) -> bool:
        """Whether windows use the retain set: for the forgetting guard, or for replay."""
        return self.owner.retain_margin is not None or self.owner.replay > 0

    def open_retain(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """The new window's retain set: the base model's answers (made now with the base loaded, the first
        time), split for replay, snapshotted beside the window's examples, and the base model's score on
        the scored part (cached by its digest). None when there is nothing to score (a classifier whose
        app added no general example: a `retain_empty` event says so)."""
        owner = self.owner
        model, trainer = owner.require_model()
        self.load_start(None)  # the base: it answers the prompts and is what the guard compares with
        learner = self.learner(state)

        def paced() -> bool:
            # Read before every new token: pause() and stop() are seen within one, and the threads follow
            # the cores the app leaves free, as a step's do (on a busy core, all of torch's workers stall).
            learner.fit_threads()
            return self.interrupted()

        try:
            records = owner.retain_set.records(model, trainer, paced)
        except InterruptedError:
            raise Interrupted() from None
        if not records:
            owner.events.emit("retain_empty", reason="no general examples to score a candidate on "
                                                     "(Personaliser.add_retain): the forgetting guard checks nothing")
            return None
        split = RetainSplit.of(records, owner.replay)
        write_snapshot(split.scored, self.directory / "retain_scored.jsonl")
        if split.replayed:
            write_snapshot(split.replayed, self.directory / "retain_replay.jsonl")
        key = {"digest": digest_of(split.scored), "seq_len": state["seq_len"]}
        retain = {**key, "scored": len(split.scored), "replayed": len(split.replayed)}
        cached = owner.store.get_meta("retain_base")
        if cached is not None and {k: cached.get(k) for k in key} == key:
            return {**retain, "base": float(cached["value"])}
        scored = trainer.eval_batches(model, self.directory / "retain_scored.jsonl")
        base = self.evaluate(Window(state, learner, None, [], scored), scored)
        owner.store.set_meta("retain_base", {**key, "value": base})
        return {**retain, "base": base}

    def build(self, state: dict[str, Any]) -> Window:
        model, trainer = self.owner.require_model()
        directory = self.directory
        batches = trainer.train_batches(model, directory / "train.jsonl", state["batch_size"], state["seed"])
        eval_batches = trainer.eval_batches(model, directory / "held_out.jsonl")
        if not eval_batches:
            raise NotEnoughData("the held-out examples hold too few tokens for one window")
        retain_batches = None
        if state.get("retain"):
            retain_batches = trainer.eval_batches(model, directory / "retain_scored.jsonl")
            if state["retain"]["replayed"]:
                replay = trainer.train_batches(model, directory / "retain_replay.jsonl", state["batch_size"],
                                               state["seed"] + 1)
                batches = ReplaySampler(batches, replay, state["replay"])
        learner = self.learner(state)
        if not self.measured:  # the memory policy's need before any step is measured: edgetrain's estimate
            self.need_bytes = trainer.step_estimate(model, batches.batch(0), state["method"])
        return Window(state, learner, batches, eval_batches, retain_batches)

    def resume(self, state: dict[str, Any]) -> bool:
        """Go on with the window a previous run recorded, from its last checkpoint; False (and its files
        dropped) when it no longer applies."""
        owner = self.owner
        start = owner.versions.start()
        same = (state.get("generation") == owner.versions.generation()
                and state.get("start") == (None if start is None else start.version)
                and all(state.get(k) == v for k, v in (("backend", owner.backend_name),
                                                        ("batch_size", owner.batch_size),
                                                        ("seq_len", owner.seq_len), ("steps", owner.window_steps)))
                and (owner.lr is None or state.get("lr") == owner.lr)
                and state.get("guarded") == self.guarded and state.get("replay") == owner.replay
                and (self.directory / "train.jsonl").is_file()
                and (not state.get("retain") or (self.directory / "retain_scored.jsonl").is_file()))
        if not same:
            self.discard_files()
            return False
        self.load_start(state["start"])
        window = self.build(state)
        checkpoint = window.learner.resume(self.directory / "checkpoints")
        window.checkpointed_step = window.learner.steps_done
        self.current = window
        owner.events.emit("window_resumed", window=state["number"], step=window.learner.steps_done,
                          checkpoint=None if checkpoint is None else str(checkpoint))
        return True

    def reference(self, window: Window, state: dict[str, Any]) -> float:
        """The start's held-out metric: cached when the start and the held-out examples are the same as at the
        last gate, else evaluated now."""
        store = self.owner.store
        cached = store.get_meta("reference")
        key = {"start": state["start"], "held_out_digest": state["held_out_digest"], "seq_len": state["seq_len"]}
        if cached is not None and {k: cached.get(k) for k in key} == key:
            return float(cached["value"])
        value = self.evaluate(window)
        store.set_meta("reference", {**key, "value": value})
        return value

    def evaluate(self, window: Window, batches_of: list | None = None) -> float:
        """The window's learner's metric on `batches_of` (default: the held-out examples)."""
        _, trainer = self.owner.require_model()

        def batches() -> Iterator[Any]:
            for batch in window.eval_batches if batches_of is None else batches_of:
                if self.interrupted():
                    raise Interrupted()
                window.learner.fit_threads()  # beside a busy app an evaluation stalls as a step would
                yield batch

        return float(window.learner.evaluate(batches())[trainer.metric])

    def skip(self, example_id: str, reason: str) -> None:
        if example_id not in self.reported_skips:
            self.reported_skips.add(example_id)
            self.owner.events.emit("skipped_example", id=example_id, reason=reason)

    def step(self, window: Window, result: RunResult) -> None:
        from edgetrain.methods.base import TrainingError

        events = self.owner.events
        learner = window.learner
        batch = window.batches.batch(learner.steps_done)
        try:
            stats = learner.step(batch)
        except TrainingError as exc:
            result.rejected += 1
            events.emit("rejected", window=window.state["number"], reason=f"training failed: {exc}")
            self.close()
            return
        result.steps += 1
        if not window.room_checked:
            # As `train --checkpoint-dir` does: once a step has made the optimizer's state, a checkpoint's size is
            # what it stays, and a disk that cannot hold the rotation is refused now, not at the next checkpoint.
            check_checkpoint_room(learner, self.directory / "checkpoints", self.owner.checkpoint_every)
            window.room_checked = True
        if stats.peak_bytes is not None:  # measured beats estimated: the largest step measured so far
            self.need_bytes = max(stats.peak_bytes, self.need_bytes if self.measured else 0)
            self.measured = True
        events.emit("step", window=window.state["number"], step=stats.step, loss=stats.loss,
                    seconds=stats.seconds, peak_bytes=stats.peak_bytes)
        if stats.step % self.owner.checkpoint_every == 0 and stats.step < window.state["steps"]:
            self.checkpoint()

    def checkpoint(self) -> None:
        window = self.current
        if window is None or window.learner.steps_done <= window.checkpointed_step:
            return
        path = window.learner.save_rotating(self.directory / "checkpoints")
        window.checkpointed_step = window.learner.steps_done
        self.owner.events.emit("checkpoint", window=window.state["number"], step=window.learner.steps_done,
                               path=str(path))

    def gate(self, window: Window, result: RunResult) -> None:
        owner = self.owner
        model, trainer = owner.require_model()
        state = window.state
        value = self.evaluate(window)
        reference = state["reference"]
        gained, better = gate(trainer.higher_is_better, value, reference, owner.margin)
        failed = [] if gained else ["held_out"]
        retain: dict[str, Any] = {}
        if window.retain_batches is not None:
            retain_value, retain_base = self.evaluate(window, window.retain_batches), state["retain"]["base"]
            worse = worsened_by(trainer.higher_is_better, retain_value, retain_base)
            retain = dict(retain=retain_value, retain_base=retain_base, retain_worsened=worse,
                          retain_margin=owner.retain_margin)
            if owner.retain_margin is not None and worse > owner.retain_margin:
                failed.append("forgetting")
        promote = not failed
        result.windows += 1
        owner.events.emit("evaluated", window=state["number"], metric=trainer.metric, value=value,
                          reference=reference, held_out=state["held_out"], **retain)
        common = dict(window=state["number"], metric=trainer.metric, value=value, reference=reference,
                      by=better, margin=owner.margin, **retain)
        if promote:
            candidate = self.directory / "candidate" / trainer.version_file
            make_directory(candidate.parent, "the candidate's directory")
            trainer.save(model, candidate)
            number = owner.versions.promote(candidate, parent=state["start"], generation=state["generation"],
                                            metric=trainer.metric, value=value, reference=reference,
                                            held_out=state["held_out"], trained=state["train_ids"],
                                            steps=state["steps"], keep=owner.keep_versions,
                                            retain=(retain["retain"], retain["retain_base"]) if retain else None)
            if number is not None:
                result.promoted.append(number)
                owner.store.set_meta("reference", {"start": number, "held_out_digest": state["held_out_digest"],
                                                   "seq_len": state["seq_len"], "value": value})
                owner.events.emit("promoted", version=number, **common)
        else:
            result.rejected += 1
            # Which side failed: "held_out" (no better on the user's examples than the start by the margin),
            # "forgetting" (the retain score worsened from the base model's by more than retain_margin). A
            # window rejected for forgetting says which setting would help: a store rejected window after
            # window otherwise looks broken.
            if "forgetting" in failed:
                common["advice"] = forgetting_advice(owner.bound["kind"]["task"], owner.replay, state["lr"],
                                                     owner.retain_margin)
            owner.events.emit("rejected", reason=" and ".join(failed), **common)
        owner.store.set_meta("last_gate", {"event": "promoted" if promote else "rejected",
                                           "reason": " and ".join(failed), **common})
        self.close()

    def close(self) -> None:
        self.current = None
        self.discard_files()
