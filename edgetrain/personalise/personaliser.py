"""edgetrain.Personaliser: the layer an app embeds to personalise a model on the device.

    p = Personaliser("~/.myapp/personal", model="smollm2-135m", on_event=print)
    p.add("The user's note")                      # committed to SQLite before it returns
    p.start()                                     # trains in the background while the policy allows
    p.pause(); p.resume(); p.stop()               # each takes effect within one step
    model = p.model_for_inference()               # base + the promoted adapter
    p.adapter_path("gguf")                        # the promoted adapter for llama.cpp (or "peft", "mlx-lm")

Training runs in windows of `window_steps` steps. A window starts from the promoted version (from the base
when there is none or it is stale), trains a candidate on the examples that are not held out, and ends at
the gate: the candidate is evaluated on the held-out examples (one in `holdout_every`, chosen by id, never
trained on) and promoted only when it beats what the window started from by more than `margin`. The
learner's state is checkpointed every `checkpoint_every` steps, on pause and on stop, so a run killed at
any moment resumes its window where the last checkpoint left it.

The store directory holds everything: examples.sqlite (examples, versions, state), events.jsonl,
base/ (the adapter a window starts from when it starts from the base), versions/vNNNNNN/ (promoted
adapters), window/ (the open window's example snapshots and checkpoints), run.lock.
"""
from __future__ import annotations

import hashlib
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from edgetrain.logs import get_logger
from edgetrain.personalise.errors import (BadExampleError, ModelMismatchError, PersonaliseError, StoreBusyError,
                                          WrongKindError)
from edgetrain.personalise.events import EventCallback, EventLog
from edgetrain.personalise.examples import ModelKind, example_from_body, is_held_out
from edgetrain.personalise.kinds import ClassifierKind, DecoderKind, NotEnoughData, gate, model_kind, write_snapshot
from edgetrain.personalise.policy import Decision, Policy
from edgetrain.personalise.sensors import as_sensors
from edgetrain.personalise.store import EVENTS, Store
from edgetrain.personalise.versions import Version, Versions, check_keep
from edgetrain.registry import EdgetrainError

log = get_logger(__name__)

WINDOW = "window"
BASE = "base"
LOCK = "run.lock"


class _Interrupted(Exception):
    """pause() or stop() arrived during an evaluation: it is abandoned and done again later."""


@dataclass
class RunResult:
    """What one run() did: steps taken, windows that reached the gate, versions promoted, and why it ended
    ("stop", "max_steps", "max_seconds", "policy", "paused", "waiting")."""

    steps: int = 0
    windows: int = 0
    promoted: list[int] = field(default_factory=list)
    rejected: int = 0
    reason: str = ""


@dataclass
class _Window:
    state: dict[str, Any]
    learner: Any
    batches: Any
    eval_batches: list
    checkpointed_step: int = 0


def _model_key(model: str | Path) -> str:
    """How the store remembers a base model: a path as an absolute path, a name as it is."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else str(model)


class Personaliser:
    """Personalise `model` on the examples kept in the store directory `store` (see the module docstring).

    model: a preset, pretrained name, checkpoint directory or GGUF file (as edgetrain.load_model takes);
        the store remembers it and refuses another. None: the store's (or none yet, to only add examples).
    method: the training method (decoders: mebp by default, any LoRA method of the backend; classifiers:
        bp, or fgd...). Remembered with the model.
    backend: where training runs ("torch-cpu", "torch-cuda", "mlx").
    rank, alpha, targets: the LoRA adapters of a decoder (fixed when the store is created).
    optimizer, lr, batch_size, seq_len: the learner's; window_steps, checkpoint_every: see the module docstring.
    keep_versions: how many versions are kept; margin: how much better a candidate must be (a fraction of
        perplexity, or accuracy points); holdout_every: one example in this many is held out (fixed when the
        store is created).
    max_examples, max_bytes: the retention cap (oldest dropped first), kept in the store.
    policy: when training may run (edgetrain.personalise.Policy); sensors: where readings come from (the
        device's own by default; FixedSensors or any object with read() to inject them).
    on_event: called with each event (a dict; also appended to events.jsonl).
    serve_stale: after forget(), keep serving the promoted version that saw the forgotten examples until a
        rebuilt one is promoted (True), or serve the base model meanwhile (False, the default). Kept in the store.
    chat_template: a Jinja chat template for chat examples when the model's tokenizer has none.
    memory_budget: the learner's budget guard (bytes or "512MiB").
    """

    def __init__(self, store: str | Path, model: str | Path | None = None, *, method: str | None = None,
                 backend: str = "torch-cpu", rank: int = 8, alpha: float = 16.0, targets: Iterable[str] | None = None,
                 optimizer: str = "adamw", lr: float | None = None, batch_size: int = 4, seq_len: int = 64,
                 window_steps: int = 20, checkpoint_every: int = 5, keep_versions: int = 3, margin: float = 0.0,
                 holdout_every: int | None = None, max_examples: int | None = None, max_bytes: int | None = None,
                 policy: Policy | None = None, sensors: Any = None, on_event: EventCallback | None = None,
                 serve_stale: bool | None = None, chat_template: str | None = None,
                 memory_budget: int | str | None = None, seed: int = 0, poll_seconds: float = 0.25) -> None:
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("window_steps", window_steps),
                            ("checkpoint_every", checkpoint_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PersonaliseError(f"{name} must be a whole number >= 1, got {value!r}")
        if not isinstance(margin, (int, float)) or margin < 0:
            raise PersonaliseError(f"margin must be a number >= 0, got {margin!r}")
        self.directory = Path(store).expanduser()
        self.events = EventLog(self.directory / EVENTS, on_event)
        self.store = Store(self.directory, events=self.events)
        self.versions = Versions(self.store)
        self.backend_name = backend
        self.optimizer, self.lr = optimizer, lr
        self.batch_size, self.seq_len = batch_size, seq_len
        self.window_steps, self.checkpoint_every = window_steps, checkpoint_every
        self.keep_versions = check_keep(keep_versions)
        self.margin = float(margin)
        self.policy = policy if policy is not None else Policy()
        self.sensors = as_sensors(sensors)
        self.chat_template = chat_template
        self.memory_budget = memory_budget
        self.seed = seed
        self.poll_seconds = poll_seconds
        self._lora = {"rank": rank, "alpha": alpha, **({"targets": tuple(targets)} if targets is not None else {})}
        self._model: Any = None
        self._kind: Any = None
        self._window: _Window | None = None
        self._idle: bool | None = None
        self._pause_requested = threading.Event()
        self._stop_requested = threading.Event()
        self._wake = threading.Event()
        self._acknowledged = threading.Event()
        self._requested_at = 0.0
        self.latency: float | None = None  # seconds from the last pause()/stop() to the run noticing it
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._decision: Decision | None = None
        self._read_at = 0.0
        self._need_bytes: int | None = None
        self._measured = False
        self._active = False
        self._reported_skips: set[str] = set()
        self._data_version: int | None = None
        if max_examples is not None or max_bytes is not None:
            self.store.set_retention(max_examples, max_bytes)
        if serve_stale is not None:
            self.store.set_meta("serve_stale", bool(serve_stale))
        self._bind(model, method, holdout_every)

    # -- the store's model ------------------------------------------------------------------------------
    @property
    def bound(self) -> dict[str, Any] | None:
        """What the store was created for: model, method, kind, LoRA config, held-out split; None before a
        model was given."""
        return self.store.get_meta("model")

    @property
    def serve_stale(self) -> bool:
        return bool(self.store.get_meta("serve_stale", False))

    def _bind(self, model: str | Path | None, method: str | None, holdout_every: int | None) -> None:
        bound = self.bound
        if holdout_every is not None and (isinstance(holdout_every, bool) or not isinstance(holdout_every, int)
                                          or holdout_every < 2):
            raise PersonaliseError(f"holdout_every must be a whole number >= 2, got {holdout_every!r}")
        if bound is not None:
            if model is not None and _model_key(model) != bound["name"]:
                raise ModelMismatchError(f"store {self.directory} personalises {bound['name']!r}, not "
                                         f"{_model_key(model)!r}: use another store for another base model")
            if method is not None and method != bound["method"]:
                raise ModelMismatchError(f"store {self.directory} trains with method {bound['method']!r}, not "
                                         f"{method!r} (its checkpoints and versions are that method's)")
            if holdout_every is not None and holdout_every != bound["holdout_every"]:
                raise ModelMismatchError(f"store {self.directory} holds out one example in {bound['holdout_every']}; "
                                         f"holdout_every={holdout_every} would train on held-out examples")
            return
        if model is None:
            return
        loaded = self._load_base(str(model))
        kind = model_kind(loaded)
        trainer = self._make_kind(kind)
        method = method or trainer.default_method
        self._check_method(method)
        lora = self._lora if kind.task == "lm" else None
        trainer.prepare(loaded, lora or {})
        base = self.directory / BASE / trainer.version_file
        base.parent.mkdir(exist_ok=True)
        trainer.save(loaded, base)
        record = {"name": _model_key(model), "method": method, "kind": kind.to_dict(), "lora": lora,
                  "holdout_every": holdout_every or 5, "created_backend": self.backend_name,
                  "base": str(base.relative_to(self.directory))}
        with self.store.transaction() as connection:
            if self.store.get_meta("model", None, connection) is not None:
                raise StoreBusyError(f"store {self.directory} was bound to a model by another process meanwhile")
            wrong = []
            for _, example, kind_name, body in self.store.rows(connection=connection):
                try:
                    kind.check(example_from_body(body))
                except BadExampleError as exc:
                    wrong.append(f"{example} ({exc})")
            if wrong:
                raise WrongKindError(f"store {self.directory} holds {len(wrong)} example(s) that {kind.describe()} "
                                     f"cannot learn from: {'; '.join(wrong[:5])}; forget them first")
            self.store.set_meta("model", record, connection)
        self._model, self._kind = loaded, trainer

    def _check_method(self, method: str) -> None:
        from edgetrain.backends import get_backend

        get_backend(self.backend_name).require().method_registry().get(method)  # an unknown one says which exist

    def _make_kind(self, kind: ModelKind) -> Any:
        from edgetrain.backends import get_backend

        if kind.task == "lm":
            return DecoderKind(get_backend(self.backend_name), seq_len=self.seq_len, chat_template=self.chat_template)
        return ClassifierKind(kind)

    def _load_base(self, name: str) -> Any:
        """The base model, the same weights in every process (presets are random init: seeded)."""
        import torch

        import edgetrain

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return edgetrain.load_model(name, backend=self.backend_name)

    def _require_model(self) -> tuple[Any, Any]:
        """The training model (base + adapters of the bound config) and its kind, loaded once."""
        bound = self.bound
        if bound is None:
            raise PersonaliseError(f"store {self.directory} has no model yet: pass model= (the base model to "
                                   "personalise)")
        if self._model is None:
            model = self._load_base(bound["name"])
            trainer = self._make_kind(ModelKind.from_dict(bound["kind"]))
            trainer.prepare(model, bound.get("lora") or {})
            self._model, self._kind = model, trainer
        return self._model, self._kind

    # -- examples -------------------------------------------------------------------------------------
    def add(self, example: Any) -> str:
        """Add an example (text, a chat as a list of {"role", "content"}, or (input, label) for a classifier):
        committed to disk when this returns. Its id (the existing one when it was already there)."""
        return self.store.add(example)

    def add_many(self, examples: Iterable[Any]) -> list[str]:
        """Add examples in one transaction (all or none); their ids in order."""
        return self.store.add_many(examples)

    def forget(self, ids: Iterable[str]) -> dict[str, list]:
        """Delete these examples and mark stale every version that trained on them; the next window rebuilds
        from the base without them. Returns {"forgotten": ids, "unknown": ids, "stale": versions}."""
        ids = list(dict.fromkeys(ids))
        with self.store.transaction() as connection:
            found = self.store.delete(ids, connection)
            stale = self.versions.mark_stale([example for _, example in found], connection)
            if found:
                self.versions.bump_generation(connection)
        forgotten = [example for _, example in found]
        self.store.checkpoint_wal()
        if found:
            with self._run_lock(blocking=False) as held:
                if held:  # no run is training: its window holds copies of examples; drop it now
                    self._discard_window_files()
        if forgotten:
            self.events.emit("forgotten", ids=forgotten)
        if stale:
            self.events.emit("stale", versions=stale)
        return {"forgotten": forgotten, "unknown": [i for i in ids if i not in forgotten], "stale": stale}

    def rollback(self) -> int | None:
        """Serve the version promoted before the current one (the newest earlier one that is neither stale nor
        rolled back), or the base model; returns it (None = base). The rolled-back version is never promoted
        again; training continues from the new one."""
        current, target = self.versions.rollback()
        self.events.emit("rollback", **{"from": current, "to": target if target is not None else "base"})
        return target

    def set_idle(self, idle: bool) -> None:
        """The app's idle flag, for Policy(require_idle=True): seen by the run at its next step."""
        self._idle = bool(idle)
        self._wake.set()

    # -- what the app serves -----------------------------------------------------------------------------
    def served_version(self) -> Version | None:
        """The version to serve (see serve_stale), after checking its files; None = the base model. A version
        whose files fail their checksum is marked damaged and the promotion falls back to an earlier one."""
        while True:
            version = self.versions.served(self.serve_stale)
            if version is None:
                return None
            try:
                self.versions.verify(version)
                return version
            except EdgetrainError as exc:
                target = self.versions.mark_damaged(version.version)
                self.events.emit("version_damaged", version=version.version, reason=str(exc),
                                 promoted=target if target is not None else "base")

    def adapter_path(self, format: str | None = None) -> Path | None:
        """The served adapter's path: as stored (format None), or converted to "edgetrain", "peft",
        "mlx-lm" or "gguf" (decoders). None when the base model is served."""
        version = self.served_version()
        if version is None:
            return None
        if format is None:
            return self.versions.path(version)
        bound = self.bound
        if bound["kind"]["task"] != "lm":
            raise PersonaliseError(f"a classifier's versions are its weights ({self.versions.path(version)}); "
                                   f"they have no adapter format {format!r}")
        from edgetrain.models.decoder_config import decoder_config

        return self.versions.export(version, format, base_model=bound["name"],
                                    base_config=decoder_config(bound["name"]) if format == "gguf" else None)

    def model_for_inference(self) -> Any:
        """A fresh copy of the base model with the served version loaded (the base alone when none is
        served), in eval mode: the training model is never handed out."""
        bound = self.bound
        if bound is None:
            raise PersonaliseError(f"store {self.directory} has no model yet")
        model = self._load_base(bound["name"])
        version = self.served_version()
        if version is not None:
            trainer = self._make_kind(ModelKind.from_dict(bound["kind"]))
            trainer.load(model, self.versions.path(version))
        model.eval()
        return model

    # -- status ---------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """Examples, held-out size, versions with their held-out metric, which one is promoted and served,
        the open window, what the policy last read and why training last paused."""
        with self.store.reading() as connection:
            bound = self.store.get_meta("model", None, connection)
            ids = [row[0] for row in connection.execute("SELECT id FROM examples")]
            total = connection.execute("SELECT COALESCE(SUM(bytes), 0) FROM examples").fetchone()[0]
            versions = self.versions.all(connection)
            promoted = self.versions.promoted(connection)
            window = self.store.get_meta("window", None, connection)
            policy = self.store.get_meta("policy", None, connection)
            pause = self.store.get_meta("last_pause", None, connection)
            retention = self.store.get_meta("retention", None, connection)
        every = bound["holdout_every"] if bound else None
        held_out = sum(is_held_out(i, every) for i in ids) if every else None
        serve_stale = self.serve_stale
        served = self.versions.served(serve_stale)
        with self._run_lock(blocking=False) as free:
            running = not free
        return {"store": str(self.directory), "model": bound["name"] if bound else None,
                "method": bound["method"] if bound else None, "kind": bound["kind"]["task"] if bound else None,
                "examples": len(ids), "bytes": int(total), "held_out": held_out,
                "training_examples": None if held_out is None else len(ids) - held_out,
                "retention": retention, "promoted": promoted,
                "served": served.version if served is not None else "base",
                "served_stale": bool(served is not None and served.stale), "serve_stale": serve_stale,
                "versions": [{**v.to_dict(), "promoted": v.version == promoted} for v in versions],
                "window": None if window is None else {k: window[k] for k in
                                                       ("number", "start", "train", "held_out", "reference",
                                                        "steps") if k in window},
                "running": running, "policy": policy, "last_pause": pause}

    # -- background control --------------------------------------------------------------------------
    def start(self, max_steps: int | None = None, max_seconds: float | None = None) -> threading.Thread:
        """run(wait=True) on a background thread (paused by the policy, it waits rather than returning)."""
        if self._thread is not None and self._thread.is_alive():
            raise PersonaliseError("the personaliser is already running in the background")
        self.error = None
        self._active = True  # a stop() from now on reaches the run, even before the thread has begun it

        def target() -> None:
            try:
                self.run(max_steps=max_steps, max_seconds=max_seconds, wait=True)
            except BaseException as exc:  # noqa: BLE001 -- handed to the app by stop()/join()
                self.error = exc
                self.events.emit("error", error=f"{type(exc).__name__}: {exc}")
                log.warning("the personaliser's background run failed: %r", exc)

        self._thread = threading.Thread(target=target, name="edgetrain-personaliser", daemon=True)
        self._thread.start()
        return self._thread

    def _request(self, event: threading.Event) -> None:
        self._acknowledged.clear()
        self._requested_at = time.perf_counter()
        event.set()
        self._wake.set()

    def pause(self, wait: bool = True, timeout: float | None = 60.0) -> float | None:
        """Stop training at the next step boundary (within one step) until resume(). With `wait`, returns
        once the run has stopped stepping: the seconds that took (None when no run was active)."""
        running = self._running()
        self._request(self._pause_requested)
        return self._await(wait and running, timeout)

    def resume(self) -> None:
        """Undo pause()."""
        self._pause_requested.clear()
        self._wake.set()

    def stop(self, wait: bool = True, timeout: float | None = 60.0) -> float | None:
        """End the run at the next step boundary (within one step), after a checkpoint. With `wait`, returns
        once the run has stopped stepping (the seconds that took), and joins a background run (re-raising
        what made it fail, if anything did)."""
        if not self._running():
            return None
        self._request(self._stop_requested)
        latency = self._await(wait, timeout)
        if wait and self._thread is not None:
            self._thread.join(timeout)
            if self.error is not None:
                error, self.error = self.error, None
                raise error
        return latency

    def join(self, timeout: float | None = None) -> None:
        """Wait for a background run to end by itself (max_steps / max_seconds)."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self.error is not None:
                error, self.error = self.error, None
                raise error

    def _await(self, wait: bool, timeout: float | None) -> float | None:
        if not wait:
            return None
        if not self._acknowledged.wait(timeout):
            return None
        return self.latency

    def _running(self) -> bool:
        return self._active

    def close(self) -> None:
        """Stop a background run and close the store."""
        if self._thread is not None and self._thread.is_alive():
            self.stop()
        self.store.close()

    def __enter__(self) -> "Personaliser":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the run ----------------------------------------------------------------------------------------
    @contextmanager
    def _run_lock(self, blocking: bool = True) -> Iterator[bool]:
        """The store's run lock (one training run per store, across processes). blocking=True: raises
        StoreBusyError when held elsewhere; False: yields whether it was acquired."""
        try:
            import fcntl
        except ImportError:  # no flock (Windows): one run per store is then the app's to ensure
            yield True
            return
        path = self.directory / LOCK
        handle = open(path, "a+b")
        try:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                if blocking:
                    raise StoreBusyError(f"store {self.directory} is being trained by another run "
                                         "(another process, or another Personaliser of this one)") from None
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        finally:
            handle.close()

    def run(self, max_steps: int | None = None, max_seconds: float | None = None, *, wait: bool = False) -> RunResult:
        """Train in windows while the policy allows, until `max_steps` steps or `max_seconds` seconds (either
        None: no limit), or stop(). When the policy says no (or there is not enough to train on, or the app
        paused): with `wait` it waits for that to change, else it returns (the reason is in the result). The
        window's state is checkpointed before it returns, so the next run goes on where this one ended."""
        if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 0):
            raise PersonaliseError(f"max_steps must be a whole number >= 0 or None, got {max_steps!r}")
        result = RunResult()
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        with self._run_lock():
            self._require_model()
            self._active = True
            try:
                self._clean_up()
                result.reason = self._loop(result, max_steps, deadline, wait)
            except BaseException:
                result.reason = "error"
                raise
            finally:
                self._active = False
                self._acknowledge()
                try:
                    self._checkpoint()
                finally:
                    self._window = None
                self.events.emit("stopped", reason=result.reason, steps=result.steps)
        return result

    def _acknowledge(self) -> None:
        if not self._acknowledged.is_set():
            self.latency = time.perf_counter() - self._requested_at if self._requested_at else None
            self._acknowledged.set()

    def _loop(self, result: RunResult, max_steps: int | None, deadline: float | None, wait: bool) -> str:
        paused_for: str | None = None
        waiting_for: str | None = None
        while True:
            if self._stop_requested.is_set():
                self._acknowledge()
                self._stop_requested.clear()
                return "stop"
            if max_steps is not None and result.steps >= max_steps:
                return "max_steps"
            if deadline is not None and time.monotonic() >= deadline:
                return "max_seconds"
            if self._pause_requested.is_set():
                self._acknowledge()
                if paused_for != "app":
                    paused_for = "app"
                    self._note_pause("app")
                    self._checkpoint()
                if not wait:
                    return "paused"
                self._sleep(deadline)
                continue
            decision = self._decide()
            if not decision.allowed:
                if paused_for != decision.reason:
                    paused_for = decision.reason
                    self._note_pause(decision.reason)
                    self._checkpoint()
                if not wait:
                    return "policy"
                self._sleep(deadline)
                continue
            if paused_for is not None:
                self.events.emit("resumed", after=paused_for)
                paused_for = None
            self._check_generation()
            try:
                if self._window is None:
                    self._open_window()
                    continue  # decide again: the window's first batch tells the step's memory need
            except NotEnoughData as exc:
                reason = str(exc)
                if waiting_for != reason:
                    waiting_for = reason
                    self.events.emit("waiting", reason=reason)
                if not wait:
                    return "waiting"
                self._sleep(deadline, self.poll_seconds * 4)
                continue
            except _Interrupted:
                continue
            waiting_for = None
            window = self._window
            if window.learner.steps_done < window.state["steps"]:
                self._step(window, result)
            # A window whose steps are done meets the gate at once, so a run that ends with it has judged it.
            if self._window is window and window.learner.steps_done >= window.state["steps"]:
                try:
                    self._gate(window, result)
                except _Interrupted:
                    continue

    def _sleep(self, deadline: float | None, seconds: float | None = None) -> None:
        seconds = self.poll_seconds if seconds is None else seconds
        if deadline is not None:
            seconds = max(0.0, min(seconds, deadline - time.monotonic()))
        self._wake.wait(seconds)
        self._wake.clear()

    def _interrupted(self) -> bool:
        return self._stop_requested.is_set() or self._pause_requested.is_set()

    def _note_pause(self, reason: str) -> None:
        self.events.emit("paused", reason=reason)
        self.store.set_meta("last_pause", {"reason": reason, "time": time.time()})

    def _decide(self) -> Decision:
        """The policy's decision: the sensors are read every `check_every_s`; the app's idle flag and the
        step's memory need are taken as they are now."""
        now = time.monotonic()
        previous = self._decision
        if previous is None or now - self._read_at >= self.policy.check_every_s:
            try:
                readings = self.sensors.read()
            except Exception as exc:  # noqa: BLE001 -- an injected reader's failure: treat as unknown readings
                from edgetrain.personalise.sensors import Readings

                readings = Readings(notes={"error": f"the sensors raised {type(exc).__name__}: {exc}"})
            self._read_at = now
        else:
            readings = previous.readings
        self._decision = self.policy.decide(readings, idle=self._idle, need_bytes=self._need_bytes)
        if previous is None or previous.allowed != self._decision.allowed or previous.reasons != self._decision.reasons:
            self.store.set_meta("policy", {**self._decision.to_dict(), "time": time.time()})
        return self._decision

    # -- windows -----------------------------------------------------------------------------------------
    def _window_directory(self) -> Path:
        return self.directory / WINDOW

    def _discard_window_files(self) -> None:
        shutil.rmtree(self._window_directory(), ignore_errors=True)
        self.store.set_meta("window", None)

    def _clean_up(self) -> None:
        """At the start of a run: drop version directories no row names, and the window files when no window
        is recorded (a crash between recording and deleting)."""
        self.versions.remove_orphans()
        if self.store.get_meta("window") is None:
            shutil.rmtree(self._window_directory(), ignore_errors=True)

    def _check_generation(self) -> None:
        """Abandon the open window when forget() or rollback() (in any process) invalidated it."""
        version = self.store.data_version()
        if version == self._data_version:
            return
        self._data_version = version
        if self._window is not None and self.versions.generation() != self._window.state["generation"]:
            self.events.emit("window_abandoned", window=self._window.state["number"],
                             reason="examples were forgotten or the promoted version changed")
            self._window = None
            self._discard_window_files()

    def _learner(self, state: dict[str, Any]) -> Any:
        from edgetrain.learner import Learner

        model, trainer = self._require_model()
        lr = state["lr"]
        # Steps are measured (a memory probe costs time every step) only for the budget guard; the memory
        # policy otherwise uses edgetrain's estimate of the step (decoders).
        return Learner(model, method=state["method"], backend=self.backend_name, optimizer=self.optimizer, lr=lr,
                       seed=state["seed"], memory_budget=self.memory_budget,
                       probe=None if self.memory_budget is not None else False)

    def _load_start(self, start: int | None) -> None:
        model, trainer = self._require_model()
        if start is None:
            trainer.load(model, self.directory / self.bound["base"])
        else:
            trainer.load(model, self.versions.path(self.versions.get(start)))

    def _default_lr(self, task: str) -> float:
        if self.lr is not None:
            return self.lr
        return 1e-3 if task == "lm" else 1e-2

    def _open_window(self) -> None:
        """Resume the recorded window, or begin a new one (NotEnoughData when there is not enough to train on)."""
        bound = self.bound
        recorded = self.store.get_meta("window")
        if recorded is not None:
            try:
                if self._resume_window(recorded):
                    return
            except (NotEnoughData, _Interrupted):
                raise
            except EdgetrainError as exc:  # every checkpoint damaged, or one this learner cannot take
                self.events.emit("window_abandoned", window=recorded.get("number"), reason=str(exc))
                self._window = None
                self._discard_window_files()
        model, trainer = self._require_model()
        with self.store.reading() as connection:
            generation = self.versions.generation(connection)
            start = self.versions.start(connection)
            high_water = self.store.high_water(connection)
            rows = self.store.rows(high_water, connection)
            number = int(self.store.get_meta("windows", 0, connection)) + 1
        train, held_out, held_ids = [], [], []
        for _, example_id, _, body in rows:
            try:
                example = example_from_body(body)
            except BadExampleError as exc:
                self._skip(example_id, f"damaged in the store ({exc})")
                continue
            if is_held_out(example_id, bound["holdout_every"]):
                held_out.append(example)
                held_ids.append(example_id)
            else:
                train.append(example)
        train_records, skipped = trainer.records(model, train)
        held_records, held_skipped = trainer.records(model, held_out)
        for example_id, reason in skipped + held_skipped:
            self._skip(example_id, reason)
        skipped_ids = {example_id for example_id, _ in skipped}
        train_ids = [example.id for example in train if example.id not in skipped_ids]
        if not train_records:
            raise NotEnoughData(f"no training examples yet ({len(held_out)} held out)")
        if not held_records:
            raise NotEnoughData(f"no held-out examples yet to judge a candidate by (one in {bound['holdout_every']} "
                                f"is held out, chosen by id; {len(train_records)} training examples)")
        directory = self._window_directory()
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        write_snapshot(train_records, directory / "train.jsonl")
        write_snapshot(held_records, directory / "held_out.jsonl")
        state = {"number": number, "start": None if start is None else start.version, "generation": generation,
                 "seed": self.seed * 1_000_003 + number, "steps": self.window_steps, "method": bound["method"],
                 "backend": self.backend_name, "lr": self._default_lr(bound["kind"]["task"]),
                 "batch_size": self.batch_size, "seq_len": self.seq_len, "train": len(train_records),
                 "held_out": len(held_records), "train_ids": train_ids,
                 "held_out_digest": hashlib.sha256(",".join(sorted(held_ids)).encode()).hexdigest()}
        self._load_start(state["start"])
        window = self._build(state)
        state["reference"] = self._reference(window, state)
        with self.store.transaction() as connection:
            if self.versions.generation(connection) != generation:
                raise _Interrupted()  # forgotten or rolled back meanwhile: begin again
            self.store.set_meta("window", state, connection)
            self.store.set_meta("windows", number, connection)
        self._window = window
        self.events.emit("window", window=number, start=state["start"] if state["start"] is not None else "base",
                         train=state["train"], held_out=state["held_out"], metric=trainer.metric,
                         reference=state["reference"])

    def _build(self, state: dict[str, Any]) -> _Window:
        model, trainer = self._require_model()
        directory = self._window_directory()
        batches = trainer.train_batches(model, directory / "train.jsonl", state["batch_size"], state["seed"])
        eval_batches = trainer.eval_batches(model, directory / "held_out.jsonl")
        if not eval_batches:
            raise NotEnoughData("the held-out examples hold too few tokens for one window")
        learner = self._learner(state)
        if not self._measured:  # the memory policy's need before any step is measured: edgetrain's estimate
            self._need_bytes = trainer.step_estimate(model, batches.batch(0), state["method"])
        return _Window(state, learner, batches, eval_batches)

    def _resume_window(self, state: dict[str, Any]) -> bool:
        """Go on with the window a previous run recorded, from its last checkpoint; False (and its files
        dropped) when it no longer applies."""
        start = self.versions.start()
        same = (state.get("generation") == self.versions.generation()
                and state.get("start") == (None if start is None else start.version)
                and all(state.get(k) == v for k, v in (("backend", self.backend_name), ("batch_size", self.batch_size),
                                                        ("seq_len", self.seq_len), ("steps", self.window_steps)))
                and (self.lr is None or state.get("lr") == self.lr)
                and (self._window_directory() / "train.jsonl").is_file())
        if not same:
            self._discard_window_files()
            return False
        self._load_start(state["start"])
        window = self._build(state)
        checkpoint = window.learner.resume(self._window_directory() / "checkpoints")
        window.checkpointed_step = window.learner.steps_done
        self._window = window
        self.events.emit("window_resumed", window=state["number"], step=window.learner.steps_done,
                         checkpoint=None if checkpoint is None else str(checkpoint))
        return True

    def _reference(self, window: _Window, state: dict[str, Any]) -> float:
        """The start's held-out metric: cached when the start and the held-out examples are the same as at the
        last gate, else evaluated now."""
        cached = self.store.get_meta("reference")
        key = {"start": state["start"], "held_out_digest": state["held_out_digest"], "seq_len": state["seq_len"]}
        if cached is not None and {k: cached.get(k) for k in key} == key:
            return float(cached["value"])
        value = self._evaluate(window)
        self.store.set_meta("reference", {**key, "value": value})
        return value

    def _evaluate(self, window: _Window) -> float:
        _, trainer = self._require_model()

        def batches() -> Iterator[Any]:
            for batch in window.eval_batches:
                if self._interrupted():
                    raise _Interrupted()
                yield batch

        return float(window.learner.evaluate(batches())[trainer.metric])

    def _skip(self, example_id: str, reason: str) -> None:
        if example_id not in self._reported_skips:
            self._reported_skips.add(example_id)
            self.events.emit("skipped_example", id=example_id, reason=reason)

    def _step(self, window: _Window, result: RunResult) -> None:
        from edgetrain.methods.base import TrainingError

        learner = window.learner
        batch = window.batches.batch(learner.steps_done)
        try:
            stats = learner.step(batch)
        except TrainingError as exc:
            result.rejected += 1
            self.events.emit("rejected", window=window.state["number"], reason=f"training failed: {exc}")
            self._close_window()
            return
        result.steps += 1
        if stats.peak_bytes is not None:  # measured beats estimated: the largest step measured so far
            self._need_bytes = max(stats.peak_bytes, self._need_bytes if self._measured else 0)
            self._measured = True
        self.events.emit("step", window=window.state["number"], step=stats.step, loss=stats.loss,
                         seconds=stats.seconds, peak_bytes=stats.peak_bytes)
        if stats.step % self.checkpoint_every == 0 and stats.step < window.state["steps"]:
            self._checkpoint()

    def _checkpoint(self) -> None:
        window = self._window
        if window is None or window.learner.steps_done <= window.checkpointed_step:
            return
        path = window.learner.save_rotating(self._window_directory() / "checkpoints")
        window.checkpointed_step = window.learner.steps_done
        self.events.emit("checkpoint", window=window.state["number"], step=window.learner.steps_done, path=str(path))

    def _gate(self, window: _Window, result: RunResult) -> None:
        model, trainer = self._require_model()
        state = window.state
        value = self._evaluate(window)
        reference = state["reference"]
        promote, better = gate(trainer.higher_is_better, value, reference, self.margin)
        result.windows += 1
        self.events.emit("evaluated", window=state["number"], metric=trainer.metric, value=value,
                         reference=reference, held_out=state["held_out"])
        common = dict(window=state["number"], metric=trainer.metric, value=value, reference=reference,
                      by=better, margin=self.margin)
        if promote:
            candidate = self._window_directory() / "candidate" / trainer.version_file
            candidate.parent.mkdir(exist_ok=True)
            trainer.save(model, candidate)
            number = self.versions.promote(candidate, parent=state["start"], generation=state["generation"],
                                           metric=trainer.metric, value=value, reference=reference,
                                           held_out=state["held_out"], trained=state["train_ids"],
                                           steps=state["steps"], keep=self.keep_versions)
            if number is not None:
                result.promoted.append(number)
                self.store.set_meta("reference", {"start": number, "held_out_digest": state["held_out_digest"],
                                                  "seq_len": state["seq_len"], "value": value})
                self.events.emit("promoted", version=number, **common)
        else:
            result.rejected += 1
            self.events.emit("rejected", **common)
        self._close_window()

    def _close_window(self) -> None:
        self._window = None
        self._discard_window_files()

