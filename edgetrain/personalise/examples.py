"""The user's examples: their three kinds, one canonical form each, and the id that form hashes to.

- text: a string (a note, a message); a decoder learns every token of it;
- chat: a list of `{"role": "system" | "user" | "assistant", "content": str}` messages with at least one
  assistant message; a decoder learns the assistant's turns only (rendered with the model's chat template,
  edgetrain.data.chat_template);
- labelled: an `(input, label)` pair for a classifier: the input a flat list of finite numbers, the label a
  class index.

The canonical form is compact JSON with sorted keys (`{"kind": ..., ...}`); an example's id is the first 16
hex digits of its SHA-256, so the same example always has the same id, in any process, and adding it again
finds it. Which examples are held out (evaluated on, never trained on) is a function of the id alone.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

from edgetrain.personalise.errors import BadExampleError, WrongKindError

KINDS = ("text", "chat", "labelled")
# What each kind of model learns from.
KINDS_FOR_TASK = {"lm": ("text", "chat"), "classify": ("labelled",)}
ID_HEX_DIGITS = 16


@dataclass(frozen=True)
class Example:
    """One example in canonical form: `body` is the JSON the store keeps, `id` its hash."""

    kind: str
    body: str

    @property
    def id(self) -> str:
        return example_id(self.body)

    @property
    def value(self) -> dict[str, Any]:
        return json.loads(self.body)

    def record(self) -> dict[str, Any]:
        """The example as a training record: {"text": ...}, {"messages": [...]} or {"input": [...], "label": k}."""
        value = self.value
        del value["kind"]
        return value


def example_id(body: str) -> str:
    return hashlib.sha256(body.encode("utf-8")).hexdigest()[:ID_HEX_DIGITS]


def _canonical(value: dict[str, Any]) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _chat(messages: Any) -> list[dict[str, str]]:
    # The JSONL reader's checks (roles, string contents, at least one assistant message), on the same record.
    # Imported here: edgetrain.data loads torch, which a process that only adds text need not.
    from edgetrain.data.jsonl import JsonlError, parse_record

    try:
        checked = parse_record(json.dumps({"messages": messages}).encode("utf-8"), "chat example")
    except (TypeError, ValueError) as exc:
        if isinstance(exc, JsonlError):
            raise BadExampleError(str(exc)) from None
        raise BadExampleError(f"chat example: the messages are not JSON values ({exc})") from None
    # Only role and content are kept: other keys (timestamps, names) are not what the model learns.
    return [{"role": m["role"], "content": m["content"]} for m in checked]


def _numbers(values: Any) -> list[float]:
    if hasattr(values, "tolist") and callable(values.tolist):  # numpy arrays, torch tensors
        values = values.tolist()
    flat: list[Any] = []
    pending = [values]
    while pending:
        item = pending.pop()
        if isinstance(item, (list, tuple)):
            pending.extend(reversed(item))
        else:
            flat.append(item)
    numbers = []
    for item in flat:
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            raise BadExampleError(f"labelled example: the input must be numbers, found {type(item).__name__}")
        if not math.isfinite(item):
            raise BadExampleError(f"labelled example: the input holds {item!r}; every value must be finite")
        numbers.append(float(item))
    if not numbers:
        raise BadExampleError("labelled example: the input is empty")
    return numbers


def _label(label: Any) -> int:
    if hasattr(label, "item") and callable(label.item):
        label = label.item()
    if isinstance(label, bool) or not isinstance(label, int) or label < 0:
        raise BadExampleError(f"labelled example: the label must be a class index (an int >= 0), got {label!r}")
    return label


def parse_example(value: Any) -> Example:
    """An example from what an app hands over: a string (text), a list of messages (chat), an
    `(input, label)` pair, or a dict {"text": ...} / {"messages": [...]} / {"input": ..., "label": ...}
    (a JSONL line's record). Anything else is a BadExampleError."""
    if isinstance(value, Example):
        return value
    if isinstance(value, Mapping):
        keys = set(value)
        if keys == {"text"}:
            value = value["text"]
        elif keys == {"messages"}:
            value = list(value["messages"]) if isinstance(value["messages"], (list, tuple)) else value["messages"]
            if not isinstance(value, list):
                raise BadExampleError("chat example: \"messages\" must be a list of messages")
        elif keys == {"input", "label"}:
            value = (value["input"], value["label"])
        else:
            raise BadExampleError(f"an example record needs \"text\", \"messages\", or \"input\" and \"label\"; "
                                  f"got keys {sorted(map(str, keys))}")
    if isinstance(value, str):
        if not value.strip():
            raise BadExampleError("text example: the text is empty")
        return Example("text", _canonical({"kind": "text", "text": value}))
    if isinstance(value, list) and (not value or isinstance(value[0], Mapping)):
        return Example("chat", _canonical({"kind": "chat", "messages": _chat(value)}))
    if isinstance(value, tuple) and len(value) == 2:
        return Example("labelled", _canonical({"kind": "labelled", "input": _numbers(value[0]),
                                               "label": _label(value[1])}))
    raise BadExampleError(f"an example is a string (text), a list of {{'role', 'content'}} messages (chat) or an "
                          f"(input, label) pair; got {type(value).__name__}")


def example_from_body(body: str) -> Example:
    """The example the store kept (a damaged body is a BadExampleError)."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        raise BadExampleError(f"stored example is not JSON ({exc.msg})") from None
    if not isinstance(value, dict) or value.get("kind") not in KINDS:
        raise BadExampleError("stored example has no known kind")
    kind = value.pop("kind")
    example = parse_example(value)
    if example.kind != kind or example.body != body:
        raise BadExampleError("stored example is not in canonical form")
    return example


@dataclass(frozen=True)
class ModelKind:
    """What a store's model learns from: `task` "lm" (text and chats) or "classify" (`features` numbers in,
    one of `num_classes` labels out)."""

    task: str
    features: int | None = None
    num_classes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task, "features": self.features, "num_classes": self.num_classes}

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> "ModelKind":
        return cls(task=value["task"], features=value.get("features"), num_classes=value.get("num_classes"))

    def describe(self) -> str:
        if self.task == "lm":
            return "a decoder (it learns from text and chats)"
        return f"a classifier ({self.features} numbers in, {self.num_classes} classes; it learns from (input, label))"

    def check(self, example: Example) -> None:
        """WrongKindError unless this model can learn from `example`."""
        wanted = KINDS_FOR_TASK.get(self.task, ())
        if example.kind not in wanted:
            raise WrongKindError(f"a {example.kind} example for {self.describe()}")
        if example.kind == "labelled":
            value = example.value
            if self.features is not None and len(value["input"]) != self.features:
                raise WrongKindError(f"labelled example: the input has {len(value['input'])} numbers, the model "
                                     f"takes {self.features}")
            if self.num_classes is not None and value["label"] >= self.num_classes:
                raise WrongKindError(f"labelled example: label {value['label']} is outside the model's "
                                     f"{self.num_classes} classes (0..{self.num_classes - 1})")


def is_held_out(example: str, every: int) -> bool:
    """Whether the example with id `example` is held out: one in `every`, chosen by the id's hash, so the
    same examples are held out in every run and every process."""
    return int(hashlib.sha256(f"held-out:{example}".encode()).hexdigest()[:8], 16) % every == 0
