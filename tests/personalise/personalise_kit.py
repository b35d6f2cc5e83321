"""Helpers the personaliser's tests share: example texts, fast settings, an event recorder."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from edgetrain.personalise import Personaliser, Policy, is_held_out

# Small and quick: 32-token windows, 4 rows a batch, a gate every 6 steps. No forgetting guard: the tiny
# preset is randomly initialised, so its own answers (the retain set) are noise any English forgets; the
# guard's tests (test_forgetting_guard.py) turn it on where it means something.
FAST = dict(lr=5e-3, batch_size=4, seq_len=32, window_steps=6, checkpoint_every=2, holdout_every=4,
            policy=Policy(check_every_s=0), poll_seconds=0.05, retain_margin=None)


def english_texts(count: int, start: int = 0, length: int = 240) -> list[str]:
    """Real English: pieces of Python's pydoc topics, each distinct."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[key] for key in sorted(topics))
    pieces, at = [], start * length
    while len(pieces) < count:
        piece = text[at:at + length]
        at += length
        if piece.strip():
            pieces.append(piece)
    return pieces


def greek_texts(count: int, seed: int = 0, length: int = 120) -> list[str]:
    """Text in another script (random Greek words): a harmful window for a model learning English."""
    rng = random.Random(seed)
    letters = "αβγδεζηθικλμνξοπρστυφχψω"
    return [" ".join("".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(length // 5))
            for _ in range(count)]


def training_only(examples: list[Any], every: int = FAST["holdout_every"]) -> list[Any]:
    """The examples the store will train on (those not held out by their id)."""
    from edgetrain.personalise import parse_example

    return [e for e in examples if not is_held_out(parse_example(e).id, every)]


class Recorder:
    """An on_event callback that keeps the events."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def __call__(self, event: dict[str, Any]) -> None:
        self.events.append(event)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]


def make(store: str | Path, model: str | None = "tiny", **options: Any) -> Personaliser:
    return Personaliser(store, model, **{**FAST, **options})
