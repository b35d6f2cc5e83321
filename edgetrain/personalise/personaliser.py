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
trained on) and promoted only when it beats what the window started from by more than `margin` and it has
not forgotten what the base model knew: its score on the store's retain set (edgetrain.personalise.retain)
worsened by at most `retain_margin` from the base model's. The
learner's state is checkpointed every `checkpoint_every` steps, on pause and on stop, so a run killed at
any moment resumes its window where the last checkpoint left it.

The store directory holds everything: examples.sqlite (examples, versions, state), events.jsonl,
base/ (the adapter a window starts from when it starts from the base), retain/ (the base model's answers
the forgetting guard scores), versions/vNNNNNN/ (promoted adapters), window/ (the open window's example snapshots and checkpoints), run.lock.

This module is the facade an app calls. The run loop and its thread control are in
edgetrain.personalise.runner, a window's lifecycle (open, step, checkpoint, gate) in
edgetrain.personalise.window, and binding a store to its base model in edgetrain.personalise.binding.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterable, Sequence

from edgetrain.backends.load_options import LoadOptions
from edgetrain.personalise.binding import (bind, bound_load_options, check_bound, check_holdout_every, load_base,
                                           make_kind)
from edgetrain.personalise.errors import PersonaliseError
from edgetrain.personalise.events import EventCallback, EventLog
from edgetrain.personalise.examples import ModelKind, is_held_out
from edgetrain.personalise.kinds import model_kind
from edgetrain.personalise.policy import Policy
from edgetrain.personalise.retain import (DEFAULT_RETAIN_MARGIN, RetainSet, check_prompts, check_replay,
                                          check_retain_margin, default_replay)
from edgetrain.personalise.run_result import RunResult
from edgetrain.personalise.runner import Runner, run_lock
from edgetrain.personalise.sensors import as_sensors
from edgetrain.personalise.store import EVENTS, Store
from edgetrain.personalise.versions import Version, Versions, check_keep
from edgetrain.personalise.window import discard_window_files
from edgetrain.probes.glibc import fix_malloc_mmap_threshold
from edgetrain.training.threads import thread_fitter
from edgetrain.registry import EdgetrainError

__all__ = ["Personaliser", "RunResult"]


class Personaliser:
    """Personalise `model` on the examples kept in the store directory `store` (see the module docstring).

    model: a preset, pretrained name, checkpoint directory or GGUF file (as edgetrain.load_model takes);
        the store remembers it and refuses another. None: the store's (or none yet, to only add examples).
    method: the training method (decoders: mesp by default, any LoRA method of the backend; classifiers:
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
    seed: the adapters' random initialisation when the store is created, and every window's shuffle: the same
        seed and examples give the same versions in any process.
    load: how the base is held (edgetrain.LoadOptions): a GGUF's 4- and 8-bit weights packed as stored by
        default, dequantised with LoadOptions(dequantize=True), dense ones quantised with quantize_bits.
        Recorded when the store is created, so that every window and served model uses the same base;
        another one later is refused.
    retain_margin: the forgetting guard: a candidate whose retain-set score is worse than the base model's by
        more than this (a fraction of perplexity, 0.05 = 5% higher; accuracy points for classifiers) is
        rejected with reason "forgetting". None turns the guard off.
    retain_prompts: the general prompts whose base-model answers make a decoder's retain set (default:
        edgetrain.personalise.general_prompts); the app's own, recorded in the store when given.
    replay: a fraction of each window's batches drawn from the retain set, so that training itself forgets
        less; the guard then scores only the retain records replay never sees. None (the default): 0.25 for a
        decoder while the guard is on (without it an Instruct model trained on plain notes is rejected for
        forgetting window after window: docs/personalise.md), 0 for a classifier or with the guard off.
    threads: the learner's intra-op threads. "auto" (default) fits them, between steps, to the cores other
        processes leave free (edgetrain.training.threads): beside a busy app a step on a taken core stalls
        every torch worker. A number fixes them; None leaves torch's setting alone.
    """

    def __init__(self, store: str | Path, model: str | Path | None = None, *, method: str | None = None,
                 backend: str = "torch-cpu", rank: int = 8, alpha: float = 16.0, targets: Iterable[str] | None = None,
                 optimizer: str = "adamw", lr: float | None = None, batch_size: int = 4, seq_len: int = 64,
                 window_steps: int = 20, checkpoint_every: int = 5, keep_versions: int = 3, margin: float = 0.0,
                 holdout_every: int | None = None, max_examples: int | None = None, max_bytes: int | None = None,
                 policy: Policy | None = None, sensors: Any = None, on_event: EventCallback | None = None,
                 serve_stale: bool | None = None, chat_template: str | None = None,
                 memory_budget: int | str | None = None, seed: int = 0, poll_seconds: float = 0.25,
                 load: LoadOptions | None = None, threads: int | str | None = "auto",
                 retain_margin: float | None = DEFAULT_RETAIN_MARGIN, retain_prompts: Sequence[str] | None = None,
                 replay: float | None = None) -> None:
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("window_steps", window_steps),
                            ("checkpoint_every", checkpoint_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PersonaliseError(f"{name} must be a whole number >= 1, got {value!r}")
        if not isinstance(margin, (int, float)) or margin < 0:
            raise PersonaliseError(f"margin must be a number >= 0, got {margin!r}")
        self.retain_margin = check_retain_margin(retain_margin)
        self._replay_requested = check_replay(replay)
        prompts = check_prompts(retain_prompts)
        self.directory = Path(store).expanduser()
        self.events = EventLog(self.directory / EVENTS, on_event)
        self.store = Store(self.directory, events=self.events)
        self.versions = Versions(self.store)
        self.retain_set = RetainSet(self.directory, self.store, self.events)
        self.backend_name = backend
        self.optimizer, self.lr = optimizer, lr
        # One fitter for every window's learner: beside a busy app a window starts on the cores it had left.
        self.threads = thread_fitter(threads)
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
        if load is not None and not isinstance(load, LoadOptions):
            raise PersonaliseError(f"load must be a LoadOptions (edgetrain.LoadOptions), got {type(load).__name__}")
        self._load_requested = load
        self._lora = {"rank": rank, "alpha": alpha, **({"targets": tuple(targets)} if targets is not None else {})}
        self._model: Any = None
        self._kind: Any = None
        self._runner = Runner(self)  # the run loop, its thread control and the open window
        if max_examples is not None or max_bytes is not None:
            self.store.set_retention(max_examples, max_bytes)
        if serve_stale is not None:
            self.store.set_meta("serve_stale", bool(serve_stale))
        self._bind(model, method, holdout_every)
        if prompts is not None and prompts != self.retain_set.prompts():
            self.retain_set.set_prompts(prompts)

    # -- the store's model ------------------------------------------------------------------------------
    @property
    def bound(self) -> dict[str, Any] | None:
        """What the store was created for: model, method, kind, LoRA config, held-out split; None before a
        model was given."""
        return self.store.get_meta("model")

    @property
    def replay(self) -> float:
        """The fraction of each window's batches replayed from the retain set: the app's, else the default for
        the store's kind of model (retain.default_replay)."""
        if self._replay_requested is not None:
            return self._replay_requested
        bound = self.bound
        return default_replay(bound["kind"]["task"] if bound else None, self.retain_margin)

    @property
    def serve_stale(self) -> bool:
        return bool(self.store.get_meta("serve_stale", False))

    def _bind(self, model: str | Path | None, method: str | None, holdout_every: int | None) -> None:
        bound = self.bound
        check_holdout_every(holdout_every)
        if bound is not None:
            check_bound(self.directory, bound, model, method, holdout_every, self._load_requested)
            return
        if model is None:
            return
        loaded = self._load_base(str(model))
        kind = model_kind(loaded)
        trainer = self._make_kind(kind)
        bind(self.store, self.directory, model, loaded, kind, trainer, method=method, holdout_every=holdout_every,
             lora=self._lora, backend_name=self.backend_name, load=self.load_options, seed=self.seed)
        self._model, self._kind = loaded, trainer

    def _make_kind(self, kind: ModelKind) -> Any:
        return make_kind(kind, self.backend_name, self.seq_len, self.chat_template)

    @property
    def load_options(self) -> LoadOptions:
        """How the base is held: the store's record once bound, else what was asked for (packed by default)."""
        bound = self.bound
        if bound is not None:
            return bound_load_options(self.directory, bound)
        return self._load_requested or LoadOptions()

    def _load_base(self, name: str) -> Any:
        """The base model, the same weights in every process (presets are random init: seeded)."""
        # As `edgetrain train` does through its memory probe: with glibc's dynamic mmap threshold, blocks
        # of up to 32 MiB freed by a step stay resident in the heap and the next steps fragment it (on
        # SmolLM2 a window's steps held 70 MiB more than train's). Pinned, every block of 64 KiB or more
        # goes back to the kernel when freed. No-op off glibc.
        fix_malloc_mmap_threshold()
        return load_base(name, self.backend_name, self.seed, self.load_options)

    def require_model(self) -> tuple[Any, Any]:
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

    def add_retain(self, examples: Iterable[Any]) -> list[str]:
        """Add examples the app marks as general to the retain set (a classifier's (input, label) pairs, a
        decoder's texts or chats): the forgetting guard scores every candidate on them, and only replay
        trains on them. In one transaction; their ids."""
        return self.store.add_retain(examples)

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
            with run_lock(self.directory, blocking=False) as held:
                if held:  # no run is training: its window holds copies of examples; drop it now
                    discard_window_files(self.directory, self.store)
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
        self._runner.set_idle(idle)


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
        the open window, the last gate's outcome (with what to change when it rejected for forgetting), what
        the policy last read and why training last paused."""
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
            retain_base = self.store.get_meta("retain_base", None, connection)
            last_gate = self.store.get_meta("last_gate", None, connection)
        every = bound["holdout_every"] if bound else None
        held_out = sum(is_held_out(i, every) for i in ids) if every else None
        serve_stale = self.serve_stale
        served = self.versions.served(serve_stale)
        with run_lock(self.directory, blocking=False) as free:
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
                "running": running, "policy": policy, "last_pause": pause, "last_gate": last_gate,
                "guard": {"retain_margin": self.retain_margin, "replay": self.replay,
                          "base": None if retain_base is None else retain_base.get("value"),
                          **self.retain_set.status()}}

    # -- background control --------------------------------------------------------------------------
    @property
    def latency(self) -> float | None:
        """Seconds from the last pause()/stop() to the run noticing it."""
        return self._runner.latency

    @latency.setter
    def latency(self, value: float | None) -> None:
        self._runner.latency = value

    @property
    def error(self) -> BaseException | None:
        """What made the background run fail (None when nothing did, or once stop()/join() raised it)."""
        return self._runner.error

    @error.setter
    def error(self, value: BaseException | None) -> None:
        self._runner.error = value

    def start(self, max_steps: int | None = None, max_seconds: float | None = None) -> threading.Thread:
        """run(wait=True) on a background thread (paused by the policy, it waits rather than returning)."""
        return self._runner.start(max_steps, max_seconds)

    def pause(self, wait: bool = True, timeout: float | None = 60.0) -> float | None:
        """Stop training at the next step boundary (within one step) until resume(). With `wait`, returns
        once the run has stopped stepping: the seconds that took (None when no run was active)."""
        return self._runner.pause(wait, timeout)

    def resume(self) -> None:
        """Undo pause()."""
        self._runner.resume()

    def stop(self, wait: bool = True, timeout: float | None = 60.0) -> float | None:
        """End the run at the next step boundary (within one step), after a checkpoint. With `wait`, returns
        once the run has stopped stepping (the seconds that took), and joins a background run (re-raising
        what made it fail, if anything did)."""
        return self._runner.stop(wait, timeout)

    def join(self, timeout: float | None = None) -> None:
        """Wait for a background run to end by itself (max_steps / max_seconds)."""
        self._runner.join(timeout)

    def close(self) -> None:
        """Stop a background run and close the store."""
        if self._runner.alive():
            self.stop()
        self.store.close()

    def __enter__(self) -> "Personaliser":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the run ----------------------------------------------------------------------------------------
    def run(self, max_steps: int | None = None, max_seconds: float | None = None, *, wait: bool = False) -> RunResult:
        """Train in windows while the policy allows, until `max_steps` steps or `max_seconds` seconds (either
        None: no limit), or stop(). When the policy says no (or there is not enough to train on, or the app
        paused): with `wait` it waits for that to change, else it returns (the reason is in the result). The
        window's state is checkpointed before it returns, so the next run goes on where this one ended."""
        return self._runner.run(max_steps, max_seconds, wait)
