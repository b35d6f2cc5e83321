#!/usr/bin/env python3
"""Does the personaliser keep what the model knew? Four arms side by side in one run, on a real model:

  defaults       Personaliser(store, model) with no option: what an app gets (guard on, replay 0.25)
  no guard       the gate sees the user's held-out examples only (retain_margin=None; no replay)
  guard          the gate: the user's side, and the retain set's score worsened by at most 5%; no replay
  guard+replay   the same, with a quarter of each window's batches drawn from the retain set
  guard+replay 0.5   half of them (run it with --arms)

Each arm gets the same stream of one user's notes, from one domain: Python's documentation (pydoc topics),
split by topic into notes, a quarter of them added before each of the windows. After each window the served
model (base + the promoted adapter) is scored on three sets, the same for every arm:

  user      perplexity of pydoc topics never added (the user's domain, text the store never saw)
  general   perplexity of Debian's fortunes (English from another source: what personalising must not lose)
  retain    perplexity of the base model's own answers to the shipped general prompts (the guard's set)

and the last line gives each arm's change from the base model. Every setting is the Personaliser's default
(mesp, AdamW lr 1e-3, batch 4 x 64 tokens, 20 steps a window, the GGUF's 4-bit base kept packed) unless a
flag says otherwise. It also times the making of the retain set against the guard arm's first window.

  .venv/bin/python tools/bench_forgetting.py            # SmolLM2-135M-Instruct (GGUF), four arms: an hour or more on 2 cores
  .venv/bin/python tools/bench_forgetting.py --arms "defaults,guard"   # the arms named
  .venv/bin/python tools/bench_forgetting.py --quick    # the tiny preset, one short window: a smoke run
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_personalise import corpus_documents  # noqa: E402
from bench_personaliser import pydoc_notes  # noqa: E402

from edgetrain.data import TextStream  # noqa: E402
from edgetrain.models.generate import held_out_loss  # noqa: E402
from edgetrain.personalise import Personaliser, Policy  # noqa: E402

ARMS = {"defaults": dict(), "no guard": dict(retain_margin=None), "guard": dict(replay=0.0),
        "guard+replay": dict(replay=0.25), "guard+replay 0.5": dict(replay=0.5)}
DEFAULT_ARMS = ("defaults", "no guard", "guard", "guard+replay")
# The guard arms run first: the no-guard arm makes no retain set, and is scored on a guard arm's (the same
# base answers the same prompts the same way: greedy).
ORDER = ("defaults", "guard", "guard+replay", "guard+replay 0.5", "no guard")


def text_batches(text: str, tokenizer: Any, seq: int, batches: int) -> list:
    return list(TextStream(text, seq_len=seq, batch_size=4, tokenizer=tokenizer, epochs=1))[:batches]


def scores(personaliser: Personaliser, sets: dict[str, list], retain_file: Path) -> dict[str, float]:
    """Perplexity of the served model on each set, and on the retain set's answers."""
    model = personaliser.model_for_inference()
    _, kind = personaliser.require_model()
    figures = {name: held_out_loss(model, batches).perplexity for name, batches in sets.items()}
    figures["retain"] = held_out_loss(model, kind.eval_batches(model, retain_file)).perplexity
    return figures


def run_arm(name: str, args: argparse.Namespace, root: Path, notes: list[str], sets: dict[str, list],
            retain_file: Path | None) -> dict[str, Any]:
    events: list[dict] = []
    options = dict(ARMS[name])
    if args.retain_margin is not None and "retain_margin" not in options:
        options["retain_margin"] = args.retain_margin
    personaliser = Personaliser(root / name, model=args.model, window_steps=args.window_steps, lr=args.lr,
                                batch_size=args.batch, seq_len=args.seq, policy=Policy(), on_event=events.append,
                                threads=args.threads, **options)
    per_window = max(1, len(notes) // args.windows)
    rows = []
    for window in range(args.windows):
        personaliser.add_many(notes[window * per_window:(window + 1) * per_window])
        first = len(events)
        personaliser.run(max_steps=args.window_steps)
        new = events[first:]
        gate = [e for e in new if e["event"] in ("promoted", "rejected")]
        retain_file = retain_file or root / name / "retain" / "answers.jsonl"
        row = {"window": window + 1, "gate": gate[-1]["event"] if gate else "not reached",
               "reason": gate[-1].get("reason", "") if gate else "",
               "step_seconds": sum(e["seconds"] for e in new if e["event"] == "step"),
               "served": personaliser.status()["served"], **scores(personaliser, sets, retain_file)}
        built = [e for e in new if e["event"] == "retain_built"]
        if built:
            row["retain_built_seconds"] = built[0]["seconds"]
        rows.append(row)
        print(f"  {name:>12} window {row['window']}: {row['gate']}{' (' + row['reason'] + ')' if row['reason'] else ''}"
              f", user {row['user']:.3f}, general {row['general']:.3f}, retain {row['retain']:.3f}", flush=True)
    personaliser.close()
    return {"rows": rows, "retain_file": retain_file}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(Path.home() / ".cache/edgetrain/smollm2-135m/"
                                               "SmolLM2-135M-Instruct.Q4_1.gguf"),
                        help="the base model (default: SmolLM2-135M-Instruct's GGUF; smollm2-135m fetches it)")
    parser.add_argument("--windows", type=int, default=4, help="windows of notes in the stream")
    parser.add_argument("--window-steps", type=int, default=20, help="steps a window (the Personaliser's default)")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: the Personaliser's, 1e-3)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--retain-margin", type=float, default=None, help="the guard arms' (default: 0.05)")
    parser.add_argument("--threads", default="auto", help="the learner's threads (default: auto)")
    parser.add_argument("--eval-batches", type=int, default=8, help="batches of 4 x --eval-seq tokens a set")
    parser.add_argument("--eval-seq", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="the tiny preset, short windows: a smoke run")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                        help=f"comma-separated arms to run, of: {', '.join(ARMS)} (default: {','.join(DEFAULT_ARMS)})")
    parser.add_argument("--json", default=None, help="write every figure here")
    args = parser.parse_args(argv)
    args.arms = [name.strip() for name in args.arms.split(",") if name.strip()]
    unknown = [name for name in args.arms if name not in ARMS]
    if unknown or not args.arms:
        parser.error(f"--arms: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(ARMS)}")
    if args.threads != "auto":
        args.threads = int(args.threads)
    if args.quick:
        args.model, args.windows, args.window_steps, args.seq, args.eval_batches = "tiny", 2, 3, 32, 2
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    documents, train_keys, held_keys, notes = pydoc_notes()
    fortunes = corpus_documents("fortunes")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-forgetting-") as directory:
        root = Path(directory)
        probe = Personaliser(root / "probe", model=args.model, retain_margin=None)
        tokenizer = getattr(probe.model_for_inference(), "tokenizer", None)
        sets = {"user": text_batches("\n\n".join(documents[k] for k in held_keys), tokenizer, args.eval_seq,
                                     args.eval_batches),
                "general": text_batches("\n\n".join(fortunes[k] for k in sorted(fortunes)), tokenizer,
                                        args.eval_seq, args.eval_batches)}
        probe.close()
        print(f"{args.model}: {len(notes)} notes from {len(train_keys)} pydoc topics in {args.windows} windows of "
              f"{args.window_steps} steps; user = {len(held_keys)} topics never added, general = fortunes",
              flush=True)
        results, retain_file = {}, None
        for name in (name for name in ORDER if name in args.arms):
            results[name] = run_arm(name, args, root, notes, sets, retain_file)
            retain_file = results[name]["retain_file"]
        # The base model's figures: the served model before any version, from a store of its own.
        base_store = Personaliser(root / "base", model=args.model, retain_margin=None)
        base = scores(base_store, sets, retain_file)
        base_store.close()
    print(f"\nbase model: user {base['user']:.3f}, general {base['general']:.3f}, retain {base['retain']:.3f}")
    print(f"\n| arm | promoted / windows | user ppl | general ppl | retain ppl |")
    print("|---|---|---|---|---|")
    for name in (name for name in ARMS if name in results):
        last = results[name]["rows"][-1]
        promoted = sum(r["gate"] == "promoted" for r in results[name]["rows"])
        change = {k: 100 * (last[k] / base[k] - 1) for k in ("user", "general", "retain")}
        print(f"| {name} | {promoted} / {len(results[name]['rows'])} | {last['user']:.3f} ({change['user']:+.1f}%) "
              f"| {last['general']:.3f} ({change['general']:+.1f}%) | {last['retain']:.3f} ({change['retain']:+.1f}%) |")
    guarded = next(name for name in ORDER if name in results)
    guard = results[guarded]["rows"]
    built = guard[0].get("retain_built_seconds")
    if built is not None:
        print(f"\nmaking the retain set: {built:.1f} s; the {guarded} arm's first window trained for "
              f"{guard[0]['step_seconds']:.1f} s: {built / guard[0]['step_seconds']:.2f}x a window's steps")
    print(f"(whole run {time.perf_counter() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "base": base,
                                               "arms": {k: v["rows"] for k, v in results.items()}},
                                              indent=1, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
