"""The forgetting guard's retain set: what the model knew before personalisation, scored at every gate.

A decoder store's retain set is the base model's own greedy answers to a fixed set of general prompts
(edgetrain.personalise.general_prompts, or the app's `retain_prompts`), made on the device with no download
the first time a run needs them, plus any general examples the app adds (`Personaliser.add_retain`). A
classifier's is the examples the app adds that way. None of it is a user example: it is never held out,
never trained on unless replay is on, and forget() and the retention cap do not touch it.

The score is the gate's own metric on the retain set: perplexity of the base model's answers (the loss on
the assistant's turns only) for a decoder, accuracy for a classifier. A candidate is promoted only when
its score has worsened by at most `retain_margin` from the base model's (a fraction of perplexity, or
accuracy points). Why perplexity of the base's answers rather than the mean KL divergence from the base's
next-token distributions: it needs only the answers' token ids kept (the base's distributions would be
49,152 floats a token on SmolLM2, or a second forward with the adapters off at every gate), it is the
metric the user side is already gated on, and it reads the same way (docs/personalise.md).

Replay (`replay` > 0) trains on part of the retain set. Then the set is split in two by position: the
odd records are replayed, the even ones scored, so the guard never scores what was trained on. An app that
names no replay gets `default_replay`: a quarter of a decoder's batches while the guard is on (measured:
without it the guard rejected every window of plain notes on an Instruct model, docs/personalise.md), none
for a classifier, whose retain set is only what the app adds.

The answers live in `retain/answers.jsonl`, their SHA-256 and the digest of the prompts they answer in the
store's meta. A missing or damaged file, or one for other prompts, is rebuilt from the prompts with a
`retain_rebuilt` event saying why, so the guard is never silently off; the app's examples are in SQLite.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from edgetrain.personalise.errors import BadExampleError, PersonaliseError, RetainSetError
from edgetrain.personalise.examples import example_from_body
from edgetrain.personalise.general_prompts import GENERAL_PROMPTS
from edgetrain.personalise.store import Store

RETAIN = "retain"
ANSWERS = "answers.jsonl"
DEFAULT_RETAIN_MARGIN = 0.05
ANSWER_TOKENS = 48  # an answer's length cap: enough for a sentence or two, a batch of 32 in about one window


def check_retain_margin(value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
        raise PersonaliseError(f"retain_margin must be a finite number >= 0 (or None: no forgetting guard), "
                               f"got {value!r}")
    return float(value)


# task -> the replay fraction a guarded store uses when the app names none. Decoders: SmolLM2-135M-Instruct
# on plain notes, tools/bench_forgetting.py (docs/personalise.md): the guard alone rejected 4 of 4 windows for
# forgetting, a quarter replayed promoted 4 of 4 with general text within 1%. Classifiers: none, their retain
# set is the app's own labelled examples and may be empty.
DEFAULT_REPLAY = {"lm": 0.25, "classify": 0.0}
REPLAY_CEILING = 0.5  # advice never suggests more: past half, a window learns more of the retain set than the user's


def check_replay(value: float | None) -> float | None:
    """A replay fraction in [0, 1), or None: the store's default (default_replay)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise PersonaliseError(f"replay must be a fraction of the window's batches in [0, 1) (or None: the "
                               f"default for the model), got {value!r}")
    return float(value)


def default_replay(task: str | None, retain_margin: float | None) -> float:
    """The replay fraction of a store whose app named none: DEFAULT_REPLAY's for its task while the forgetting
    guard is on, none with the guard off (nothing then asks training to keep the retain set)."""
    if retain_margin is None or task is None:
        return 0.0
    return DEFAULT_REPLAY.get(task, 0.0)


def forgetting_advice(task: str, replay: float, lr: float, retain_margin: float) -> str:
    """What an app can change when the guard rejected a window for forgetting, most effective first: the
    setting and its flag, as the `rejected` event and `personalise status` say it."""
    steps = []
    if task == "classify" and replay == 0:
        steps.append("add general examples with their right labels (add_retain, `personalise add --retain`) and "
                     "replay them (replay=0.25, --replay 0.25)")
    elif replay < REPLAY_CEILING:
        more = round(min(REPLAY_CEILING, replay + 0.25), 2)
        steps.append(f"replay more of the retain set (replay={more}, --replay {more}; now {replay:g})")
    steps.append(f"train more gently (lr={lr / 2:g}, --lr {lr / 2:g}; now {lr:g})")
    looser = round(retain_margin * 2, 4) if retain_margin > 0 else 0.05
    steps.append(f"or accept more forgetting (retain_margin={looser:g}, --retain-margin {looser:g}; now "
                 f"{retain_margin:g})")
    return "; ".join(steps)


def check_prompts(prompts: Sequence[str] | None) -> list[str] | None:
    if prompts is None:
        return None
    if isinstance(prompts, str) or not all(isinstance(p, str) and p.strip() for p in prompts) or not prompts:
        raise PersonaliseError("retain_prompts must be a non-empty list of non-empty strings")
    return list(prompts)


def worsened_by(higher_is_better: bool, candidate: float, base: float) -> float:
    """How much worse the candidate's retain score is than the base model's: a fraction of the base's
    perplexity, or accuracy points (negative when it is better)."""
    if higher_is_better:
        return base - candidate
    return (candidate - base) / base if base > 0 else 0.0


def digest_of(records: Sequence[dict[str, Any]]) -> str:
    text = "".join(json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n" for r in records)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class RetainSplit:
    """The retain set as a window uses it: the records the guard scores and those replay trains on."""

    scored: list[dict[str, Any]]
    replayed: list[dict[str, Any]]

    @classmethod
    def of(cls, records: Sequence[dict[str, Any]], replay: float) -> "RetainSplit":
        if replay > 0 and len(records) >= 2:
            return cls(list(records[0::2]), list(records[1::2]))
        return cls(list(records), [])


class RetainSet:
    """The retain set of the store in `directory` (see the module docstring)."""

    def __init__(self, directory: Path, store: Store, events: Any) -> None:
        self.directory, self.store, self.events = directory, store, events
        self.path = directory / RETAIN / ANSWERS

    def prompts(self) -> list[str]:
        return list(self.store.get_meta("retain_prompts", None) or GENERAL_PROMPTS)

    def set_prompts(self, prompts: list[str] | None) -> None:
        """Record the app's prompts (None: the shipped ones); the answers are rebuilt at the next window."""
        self.store.set_meta("retain_prompts", prompts)

    def answers(self, model: Any, trainer: Any, interrupted: Callable[[], bool]) -> list[dict[str, Any]]:
        """The base model's answers to the prompts, as training records: read back when they are there and
        sound, else made now (`model` must hold the base's weights then). [] for a kind that does not answer."""
        if not trainer.answers_prompts:
            return []
        prompts = self.prompts()
        prompts_digest = hashlib.sha256(json.dumps(prompts).encode("utf-8")).hexdigest()
        record = self.store.get_meta("retain")
        reason = None
        if record is not None:
            if record.get("prompts_digest") != prompts_digest:
                reason = "the prompts changed"
            else:
                try:
                    return self._read(record)
                except RetainSetError as exc:
                    reason = str(exc)
        started = time.perf_counter()
        try:
            records = trainer.retain_answers(model, prompts, ANSWER_TOKENS, interrupted)
        except InterruptedError:
            raise
        except Exception as exc:  # a model that cannot answer: the guard must not go quietly off
            raise RetainSetError(f"the base model could not answer the retain prompts: {exc}") from exc
        if not records:
            raise RetainSetError("the base model gave no answer with any token to score to the retain prompts")
        seconds = time.perf_counter() - started
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        # Imported here: it loads torch, which adding examples never needs.
        from edgetrain.files.atomic import atomic_write_bytes, make_directory

        make_directory(self.path.parent, "the retain set's directory")
        atomic_write_bytes(lines.encode("utf-8"), self.path)
        self.store.set_meta("retain", {"prompts_digest": prompts_digest, "count": len(records),
                                       "sha256": hashlib.sha256(lines.encode("utf-8")).hexdigest(),
                                       "seconds": round(seconds, 3), "max_new_tokens": ANSWER_TOKENS})
        if reason is None:
            self.events.emit("retain_built", answers=len(records), prompts=len(prompts), seconds=seconds)
        else:
            self.events.emit("retain_rebuilt", answers=len(records), prompts=len(prompts), seconds=seconds,
                             reason=reason)
        return records

    def _read(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            raise RetainSetError(f"{self.path} is missing") from None
        except OSError as exc:
            raise RetainSetError(f"{self.path} cannot be read ({exc})") from None
        if hashlib.sha256(data).hexdigest() != record.get("sha256"):
            raise RetainSetError(f"{self.path} is damaged (its SHA-256 is not the one recorded)")
        try:
            return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RetainSetError(f"{self.path} is damaged ({exc})") from None

    def app_examples(self) -> list[Any]:
        """The general examples the app added (Example objects), oldest first; a damaged row is an error."""
        examples = []
        for example_id, body in self.store.retain_rows():
            try:
                examples.append(example_from_body(body))
            except BadExampleError as exc:
                raise RetainSetError(f"retain example {example_id} is damaged in the store ({exc})") from None
        return examples

    def records(self, model: Any, trainer: Any, interrupted: Callable[[], bool]) -> list[dict[str, Any]]:
        """Every retain record: the base's answers, then the app's general examples that the trainer can
        use (a chat its template cannot render is left out with a `skipped_example` event)."""
        answers = self.answers(model, trainer, interrupted)
        records, skipped = trainer.records(model, self.app_examples())
        for example_id, reason in skipped:
            self.events.emit("skipped_example", id=example_id, reason=f"retain set: {reason}")
        return answers + records

    def status(self) -> dict[str, Any]:
        record = self.store.get_meta("retain") or {}
        return {"answers": record.get("count"), "built_seconds": record.get("seconds"),
                "app_examples": len(self.store.retain_rows()),
                "prompts": "app" if self.store.get_meta("retain_prompts") else "shipped"}
