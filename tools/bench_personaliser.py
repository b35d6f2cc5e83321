#!/usr/bin/env python3
"""What edgetrain.Personaliser costs and gives, on a real model, in one run:

1. overhead: the personaliser's run(max_steps=N) against a bare Learner loop of N steps of the same method,
   batch shape and optimizer, in interleaved rounds (edgetrain.profiler.bench). The personaliser's side
   pays for everything an app's call pays: the run lock, the policy's sensor readings, the event log,
   re-opening its window from the last checkpoint and checkpointing every `checkpoint_every` steps.
2. add throughput: Store.add (one durable SQLite commit per example: WAL, synchronous=FULL) and
   Store.add_many (one commit per call), against the floor of a bare sqlite3 INSERT + COMMIT with the
   same durability settings.
3. pause latency: pause() while start() trains in the background, at random moments of a step, against
   the step's own duration (a pause takes effect at the next step boundary).
4. a stream of user notes: the pydoc topics split by topic into notes and a held-out set never added;
   the notes arrive in windows, a training window runs after each, and the gate promotes or rejects its
   candidate. Held-out perplexity (the topics never added) of the base and of the served model at the end.

  .venv/bin/python tools/bench_personaliser.py                # SmolLM2-135M (GGUF), mesp (about 20 min on 2 cores)
  .venv/bin/python tools/bench_personaliser.py --quick        # the tiny preset, few steps: a smoke run
"""
from __future__ import annotations

import argparse
import random
import sqlite3
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_personalise import corpus_documents, split_documents  # noqa: E402

import edgetrain  # noqa: E402
from edgetrain.data import TextStream  # noqa: E402
from edgetrain.models.generate import held_out_loss  # noqa: E402
from edgetrain.personalise import Personaliser, Store  # noqa: E402
from edgetrain.profiler.bench import (Arm, Column, format_table, measure_interleaved, summarise,  # noqa: E402
                                      write_json)


def notes_of(documents: dict[str, str], keys: Sequence[str], min_chars: int = 200) -> list[str]:
    """The documents' paragraphs as notes, short ones merged into the next, in document order."""
    notes, pending = [], ""
    for key in keys:
        for paragraph in documents[key].split("\n\n"):
            pending = f"{pending}\n\n{paragraph}" if pending else paragraph
            if len(pending) >= min_chars:
                notes.append(pending.strip())
                pending = ""
    return notes


def pydoc_notes() -> tuple[dict[str, str], list[str], list[str], list[str]]:
    """(pydoc topics by name, topics the notes come from, topics held out, the notes): the user's stream."""
    documents = corpus_documents("pydoc")
    train_keys, held_keys = split_documents(documents, len, seed=0, held_fraction=0.1, held_tokens=20_000)
    return documents, train_keys, held_keys, notes_of(documents, train_keys)


def make_personaliser(store: Path, args: argparse.Namespace, **options: Any) -> Personaliser:
    # The gate on the user's side alone, as these figures were first measured: the forgetting guard and
    # what it costs and keeps are tools/bench_forgetting.py's.
    return Personaliser(store, model=args.model, method=args.method, seq_len=args.seq, batch_size=args.batch,
                        lr=args.lr, retain_margin=None, **options)


# -- 1. overhead -----------------------------------------------------------------------------------------
def overhead(args: argparse.Namespace, notes: list[str], root: Path) -> dict:
    personaliser = make_personaliser(root / "overhead", args, window_steps=10**6)  # one window, no gate
    personaliser.add_many(notes)
    personaliser.run(max_steps=1)  # loads the model, opens the window
    model = edgetrain.load_model(args.model)
    edgetrain.add_lora(model, rank=8, alpha=16.0)
    learner = edgetrain.Learner(model, method=args.method, optimizer="adamw", lr=personaliser.lr or 1e-3)
    stream = iter(TextStream("\n\n".join(notes), seq_len=args.seq, batch_size=args.batch,
                             tokenizer=getattr(model, "tokenizer", None), shuffle=True, epochs=None))

    def bare() -> dict:
        start = time.perf_counter()
        for _ in range(args.steps):
            learner.step(next(stream))
        return {"seconds": time.perf_counter() - start}

    def personalised() -> dict:
        start = time.perf_counter()
        result = personaliser.run(max_steps=args.steps)
        if result.steps != args.steps:
            raise SystemExit(f"the personaliser took {result.steps} steps, not {args.steps} ({result.reason})")
        return {"seconds": time.perf_counter() - start}

    samples = measure_interleaved([Arm("learner loop", bare), Arm("personaliser", personalised)],
                                  repeats=args.repeats, warmup=1, description="overhead")
    personaliser.close()
    return {arm: summarise(taken) for arm, taken in samples.items()}


# -- 2. add throughput -----------------------------------------------------------------------------------
def add_throughput(args: argparse.Namespace, root: Path) -> dict:
    rounds = iter(range(10**6))

    def sentences() -> list[str]:
        number = next(rounds)
        return [f"note {number}.{i}: the user wrote something worth keeping, at {time.time_ns()}"
                for i in range(args.adds)]

    connection = sqlite3.connect(root / "raw.sqlite", isolation_level=None)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA synchronous=FULL")
    connection.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT NOT NULL)")
    store = Store(root / "adds")

    def raw() -> dict:
        texts = sentences()
        start = time.perf_counter()
        for text in texts:
            connection.execute("BEGIN")
            connection.execute("INSERT INTO notes (body) VALUES (?)", (text,))
            connection.execute("COMMIT")
        return {"seconds per example": (time.perf_counter() - start) / len(texts)}

    def one_by_one() -> dict:
        texts = sentences()
        start = time.perf_counter()
        for text in texts:
            store.add(text)
        return {"seconds per example": (time.perf_counter() - start) / len(texts)}

    def batched() -> dict:
        texts = sentences()
        start = time.perf_counter()
        store.add_many(texts)
        return {"seconds per example": (time.perf_counter() - start) / len(texts)}

    samples = measure_interleaved([Arm("sqlite3 INSERT + COMMIT", raw), Arm("Store.add", one_by_one),
                                   Arm(f"Store.add_many ({args.adds} a call)", batched)],
                                  repeats=args.repeats, warmup=1, description="add")
    store.close()
    connection.close()
    return {arm: summarise(taken) for arm, taken in samples.items()}


# -- 3. pause latency ------------------------------------------------------------------------------------
def pause_latency(args: argparse.Namespace, notes: list[str], root: Path) -> dict:
    step_seconds: list[float] = []
    stepped = threading.Event()

    def on_event(event: dict) -> None:
        if event["event"] == "step":
            step_seconds.append(event["seconds"])
            stepped.set()

    personaliser = make_personaliser(root / "pause", args, window_steps=10**6, on_event=on_event)
    personaliser.add_many(notes)
    personaliser.start()
    latencies = []
    generator = random.Random(0)
    try:
        for _ in range(args.pauses):
            stepped.clear()
            if not stepped.wait(600):
                raise SystemExit("no training step within 10 minutes")
            time.sleep(generator.uniform(0, step_seconds[-1]))  # a random moment inside the next step
            latency = personaliser.pause()
            if latency is None:
                raise SystemExit("pause() was not acknowledged")
            latencies.append(latency)
            personaliser.resume()
    finally:
        personaliser.stop()
        personaliser.close()
    return {"pause": summarise([{"seconds": s} for s in latencies]),
            "training step": summarise([{"seconds": s} for s in step_seconds[1:]])}


# -- 4. a stream of notes --------------------------------------------------------------------------------
def notes_stream(args: argparse.Namespace, documents: dict[str, str], train_keys: Sequence[str],
                 held_keys: Sequence[str], root: Path) -> dict:
    events: list[dict] = []
    personaliser = make_personaliser(root / "notes", args, window_steps=args.window_steps, on_event=events.append)
    base = personaliser.model_for_inference()
    held_out = list(TextStream("\n\n".join(documents[key] for key in held_keys), seq_len=args.seq,
                               batch_size=args.batch, tokenizer=getattr(base, "tokenizer", None), epochs=1))
    held_out = held_out[:args.eval_batches]
    before = held_out_loss(base, held_out).perplexity
    del base
    notes = notes_of(documents, train_keys)
    per_window = max(1, len(notes) // args.windows)
    rows = []
    for window in range(args.windows):
        added = personaliser.add_many(notes[window * per_window:(window + 1) * per_window])
        first = len(events)
        result = personaliser.run(max_steps=args.window_steps)
        gate = [e for e in events[first:] if e["event"] in ("promoted", "rejected")]
        rows.append({"window": window + 1, "notes added": len(added), "steps": result.steps,
                     "gate": gate[-1]["event"] if gate else "not reached",
                     "gate metric": gate[-1].get("metric") if gate else None,
                     "candidate": gate[-1].get("value") if gate else None,
                     "starting point": gate[-1].get("reference") if gate else None,
                     "served": personaliser.status()["served"]})
    after = held_out_loss(personaliser.model_for_inference(), held_out).perplexity
    status = personaliser.status()
    personaliser.close()
    return {"before": before, "after": after, "windows": rows,
            "promoted": sum(r["gate"] == "promoted" for r in rows),
            "rejected": sum(r["gate"] == "rejected" for r in rows),
            "examples": status["examples"], "held_out_examples": status["held_out"]}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="mesp")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--steps", type=int, default=8, help="steps per overhead round and arm")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (overhead, adds)")
    parser.add_argument("--adds", type=int, default=200, help="examples per add-throughput round")
    parser.add_argument("--pauses", type=int, default=8, help="pause() calls timed")
    parser.add_argument("--windows", type=int, default=4, help="windows of notes in the stream")
    parser.add_argument("--window-steps", type=int, default=10)
    parser.add_argument("--eval-batches", type=int, default=16, help="held-out batches for perplexity")
    parser.add_argument("--quick", action="store_true", help="the tiny preset and few steps: a smoke run")
    parser.add_argument("--json", default=None, help="write every figure here")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.seq, args.steps, args.repeats, args.adds = "tiny", 64, 3, 2, 20
        args.pauses, args.windows, args.window_steps, args.eval_batches = 3, 2, 4, 4
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    documents, train_keys, held_keys, notes = pydoc_notes()
    report: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k != "json"}}
    with tempfile.TemporaryDirectory(prefix="bench-personaliser-") as directory:
        root = Path(directory)
        timed = overhead(args, notes, root)
        print(format_table(f"1. overhead: {args.steps} {args.method} steps of {args.model} "
                           f"(batch {args.batch} x {args.seq}) per round", timed, "learner loop",
                           [Column("seconds", "time", unit="s")]), flush=True)
        adds = add_throughput(args, root)
        print(format_table(f"\n2. durable adds, {args.adds} examples a round", adds, "sqlite3 INSERT + COMMIT",
                           [Column("seconds per example", "time per example", 1e-3, "ms")]), flush=True)
        pauses = pause_latency(args, notes, root)
        print(f"\n3. pause latency over {args.pauses} pauses at random moments of a step: median "
              f"{pauses['pause']['seconds'].median * 1e3:.0f} ms (max {pauses['pause']['seconds'].high * 1e3:.0f}); "
              f"a training step: median {pauses['training step']['seconds'].median * 1e3:.0f} ms "
              f"(max {pauses['training step']['seconds'].high * 1e3:.0f}); "
              f"max pause / median step {pauses['pause']['seconds'].high / pauses['training step']['seconds'].median:.2f}",
              flush=True)
        stream = notes_stream(args, documents, train_keys, held_keys, root)
        print(f"\n4. a stream of notes: {len(train_keys)} pydoc topics as {len(notes)} notes in {args.windows} "
              f"windows of {args.window_steps} steps; {len(held_keys)} topics never added are the held-out set")
        for row in stream["windows"]:
            print("   " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
        print(f"   held-out perplexity {stream['before']:.2f} (base) -> {stream['after']:.2f} (served) "
              f"({100 * (stream['after'] / stream['before'] - 1):+.1f}%); promoted {stream['promoted']}, "
              f"rejected {stream['rejected']}")
        report["stream"] = stream
    if args.json:
        write_json(args.json, {**timed, **adds, **pauses}, "learner loop", **report)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
