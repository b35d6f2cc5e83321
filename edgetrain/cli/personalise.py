"""Personalise a model on this device from examples kept in a store: add, run, status, forget, rollback.

The store is a directory (edgetrain.Personaliser): the examples in SQLite, the promoted adapter versions,
the training state. It remembers the base model and method of its first `run` and refuses others.

    edgetrain personalise add --store notes.et note1.txt chats.jsonl     # prints one id per example
    edgetrain personalise add --store notes.et --retain general.jsonl    # the forgetting guard's general examples
    echo "a note" | edgetrain personalise add --store notes.et -
    edgetrain personalise run --store notes.et --model smollm2-135m --max-seconds 600 --require-power
    edgetrain personalise status --store notes.et [--json] [--plot history.png]
    edgetrain personalise forget --store notes.et 3f2a9c0d1e4b5a6c
    edgetrain personalise rollback --store notes.et

A plain text file is one example; a .jsonl file is one example a line ({"text": ...}, {"messages": [...]}
or {"input": [...], "label": k}); `-` reads standard input (JSONL when every non-blank line is a JSON
object, else one text example).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from edgetrain.backends.load_options import LoadOptions, add_load_flags
from edgetrain.personalise.retain import DEFAULT_RETAIN_MARGIN
from edgetrain.training.threads import threads_flag


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", required=True, metavar="DIR", help="the store directory (created by the first add or run)")
    parser.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                        help="warnings and errors only")


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    add = actions.add_parser("add", help="add examples; prints one id per example",
                             description="Add examples to the store (committed before the command ends); prints "
                                         "one id per example, the existing id when it was already there.")
    _common(add)
    add.add_argument("files", nargs="+", metavar="FILE", help="text file (one example), .jsonl (one a line), or -")
    add.add_argument("--format", choices=("auto", "text", "jsonl"), default="auto",
                     help="how to read the files: by suffix (auto: .jsonl is JSONL), or all as text / all as JSONL")
    add.add_argument("--retain", action="store_true",
                     help="add them to the retain set instead (general examples the forgetting guard scores "
                          "every candidate on; never the user's, trained on only by --replay)")

    run = actions.add_parser("run", help="train while the device allows; promote only better adapters",
                             description="Train in windows while the policy allows; after each window the "
                                         "candidate is evaluated on the held-out examples and promoted only "
                                         "when better. Resumes where the last run (or crash) left off.")
    _common(run)
    run.add_argument("--model", default=None,
                     help="the base model (preset, pretrained name, checkpoint directory or .gguf); needed for a "
                          "new store, else must be the store's")
    run.add_argument("--method", default=None, help="training method (default: the store's, or mesp for "
                                                    "decoders and bp for classifiers)")
    run.add_argument("--backend", default="torch-cpu")
    add_load_flags(run, dtype_default=None)
    run.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    run.add_argument("--max-seconds", type=float, default=None, help="stop after this many seconds")
    run.add_argument("--require-power", action="store_true", help="train only on external power")
    run.add_argument("--max-temp", type=float, default=None, metavar="C",
                     help="train only while the hottest sensor is below C degrees Celsius")
    run.add_argument("--min-free-mb", type=float, default=None, metavar="M",
                     help="memory that must stay free beside the step (default 0: the step must fit)")
    run.add_argument("--unknown", choices=("allow", "deny"), default="allow",
                     help="what a reading that does not exist here (no battery, no sensors) means")
    run.add_argument("--wait", action="store_true",
                     help="when the policy says no, wait for it to change (until --max-seconds) instead of ending")
    run.add_argument("--window-steps", type=int, default=20, help="steps between held-out evaluations")
    run.add_argument("--checkpoint-every", type=int, default=5)
    run.add_argument("--lr", type=float, default=None, help="learning rate (default 1e-3 decoders, 1e-2 classifiers)")
    run.add_argument("--batch", type=int, default=4)
    run.add_argument("--seq", type=int, default=64, help="sequence length (decoders)")
    run.add_argument("--threads", default="auto", type=threads_flag, metavar="N|auto",
                     help="intra-op threads: auto (default) fits them to the cores other processes leave free, "
                          "checked between steps; a number fixes them")
    run.add_argument("--rank", type=int, default=8, help="LoRA rank (fixed when the store is created)")
    run.add_argument("--margin", type=float, default=0.0,
                     help="how much better a candidate must be: a fraction of perplexity, or accuracy points")
    run.add_argument("--retain-margin", type=float, default=DEFAULT_RETAIN_MARGIN, metavar="F",
                     help="the forgetting guard: reject a candidate whose retain-set score is worse than the base "
                          "model's by more than this (a fraction of perplexity, or accuracy points; default "
                          f"{DEFAULT_RETAIN_MARGIN})")
    run.add_argument("--no-guard", action="store_true", help="no forgetting guard (the gate sees the user's "
                                                             "held-out examples only)")
    run.add_argument("--replay", type=float, default=None, metavar="F",
                     help="draw this fraction of each window's batches from the retain set (default: 0.25 for "
                          "decoders while the guard is on, else 0)")
    run.add_argument("--retain-prompts", default=None, metavar="FILE",
                     help="general prompts, one a line, whose base-model answers make a decoder's retain set "
                          "(default: edgetrain's own)")
    run.add_argument("--keep", type=int, default=3, help="versions kept")
    run.add_argument("--holdout-every", type=int, default=None,
                     help="hold out one example in N (fixed when the store is created; default 5)")
    run.add_argument("--chat-template", default=None, metavar="FILE",
                     help="a Jinja chat template for chat examples when the model's tokenizer has none")

    status = actions.add_parser("status", help="examples, versions, what is served, what the policy read",
                                description="Examples and held-out size, versions with their held-out metric, "
                                            "which is promoted and served, what the policy last read and why "
                                            "training last paused.")
    _common(status)
    status.add_argument("--json", action="store_true", help="print the status as one JSON object")
    status.add_argument("--plot", default=None, metavar="FILE",
                        help="also draw the history to FILE (.png, .svg, .pdf, ...): each window's held-out score "
                             "against what it had to beat, its retain-set score against the base model's, "
                             "promoted and rejected windows marked (needs matplotlib: the plot extra)")

    forget = actions.add_parser("forget", help="delete examples; versions that saw them become stale",
                                description="Delete examples by id; every version that trained on them is marked "
                                            "stale and the next run rebuilds from the base without them.")
    _common(forget)
    forget.add_argument("ids", nargs="+", metavar="ID")

    rollback = actions.add_parser("rollback", help="serve the previous version (or the base model)",
                                  description="Serve the version promoted before the current one (or the base "
                                              "model); the rolled-back version is never promoted again.")
    _common(rollback)
    return parser


def _is_jsonl_text(text: str) -> bool:
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return False
    try:
        return all(isinstance(json.loads(line), dict) for line in lines)
    except json.JSONDecodeError:
        return False


def read_examples(paths: list[str], fmt: str = "auto", stdin: Any = None) -> list[Any]:
    """The examples in the files the command names, in order (a bad one is a BadExampleError naming it)."""
    from edgetrain.data.binary import check_text_file
    from edgetrain.personalise.errors import BadExampleError
    from edgetrain.personalise.examples import parse_example

    examples = []
    for name in paths:
        if name == "-":
            text, where = (stdin or sys.stdin).read(), "<stdin>"
            jsonl = fmt == "jsonl" or (fmt == "auto" and _is_jsonl_text(text))
        else:
            path = Path(name)
            if not path.is_file():
                raise BadExampleError(f"{name}: no such file")
            check_text_file(path)  # binary input is refused by name, as by every text reader (edgetrain.data.binary)
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise BadExampleError(f"{name}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
            where = name
            jsonl = fmt == "jsonl" or (fmt == "auto" and path.suffix.lower() == ".jsonl")
        if not jsonl:
            examples.append(parse_example(text))
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                examples.append(parse_example(json.loads(line)))
            except json.JSONDecodeError as exc:
                raise BadExampleError(f"{where}:{number}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            except BadExampleError as exc:
                raise BadExampleError(f"{where}:{number}: {exc}") from None
    return examples


def _event_logger():
    from edgetrain.utils.logs import get_logger

    log = get_logger("edgetrain.cli.personalise")

    def report(event: dict[str, Any]) -> None:
        kind = event["event"]
        if kind == "step":
            if event["step"] % 10 == 0:
                log.info("window %s step %s: loss %.4f", event["window"], event["step"], event["loss"])
        elif kind in ("promoted", "rejected") and "value" in event:
            retain = "" if event.get("retain") is None else \
                f"; retain set {event['metric']} {event['retain']:.4g} (base {event['retain_base']:.4g})"
            log.info("%s: window %s, held-out %s %.4g (was %.4g)%s%s%s", kind, event["window"], event["metric"],
                     event["value"], event["reference"], retain,
                     f" -> version {event['version']}" if kind == "promoted" else "",
                     f" [{event['reason']}]" if kind == "rejected" else "")
            if event.get("advice"):
                log.info("to help: %s", event["advice"])
        elif kind in ("paused", "waiting", "window", "window_resumed", "rejected", "window_abandoned",
                      "skipped_example", "version_damaged", "examples_dropped", "retain_built", "retain_rebuilt",
                      "retain_empty"):
            details = {k: v for k, v in event.items() if k not in ("event", "time", "ids")}
            log.info("%s %s", kind, json.dumps(details, default=str))
    return report


def _print_status(status: dict[str, Any]) -> None:
    kind = {"lm": "decoder", "classify": "classifier"}.get(status["kind"], "no model yet")
    print(f"store:     {status['store']}")
    print(f"model:     {status['model'] or '(none yet: run --model M)'}"
          + (f" ({status['method']}, {kind})" if status["model"] else ""))
    held = "" if status["held_out"] is None else f"; {status['held_out']} held out, {status['training_examples']} to train on"
    print(f"examples:  {status['examples']} ({status['bytes']:,} bytes){held}")
    served = status["served"]
    print(f"served:    {'the base model' if served == 'base' else f'version {served}'}"
          + (" (stale)" if status["served_stale"] else "")
          + (f"; promoted: version {status['promoted']}" if status["promoted"] not in (None, served) else ""))
    for version in status["versions"]:
        marks = [m for m, on in (("promoted", version["promoted"]), ("stale", version["stale"]),
                                 (version["state"], version["state"] != "kept")) if on]
        reference = "" if version["reference"] is None else f" (beat {version['reference']:.4g})"
        retain = "" if version.get("retain") is None else \
            f"; retain set {version['retain']:.4g} (base {version['retain_base']:.4g})"
        print(f"  v{version['version']:<4} {version['metric']} {version['value']:.4g}{reference} on "
              f"{version['held_out']} held out, {version['trained']} trained{retain}"
              + (f"  [{', '.join(marks)}]" if marks else ""))
    window = status["window"]
    if window is not None:
        start = "the base" if window["start"] is None else f"version {window['start']}"
        print(f"window:    {window['number']} from {start}, {window['steps']} steps")
    guard = status["guard"]
    if guard["answers"] is not None or guard["app_examples"]:
        base = "" if guard["base"] is None else f", the base model's score {guard['base']:.4g}"
        print(f"retain:    {guard['answers'] or 0} base-model answers ({guard['prompts']} prompts), "
              f"{guard['app_examples']} general examples{base}")
    gate = status.get("last_gate")
    if gate is not None:
        outcome = "promoted" if gate["event"] == "promoted" else f"rejected ({gate['reason']})"
        print(f"last gate: window {gate['window']} {outcome}: held-out {gate['metric']} {gate['value']:.4g} "
              f"against {gate['reference']:.4g}"
              + ("" if gate.get("retain") is None else
                 f"; retain set {gate['retain']:.4g} against the base's {gate['retain_base']:.4g}"))
        if gate.get("advice"):
            print(f"  to help: {gate['advice']}")
    print(f"running:   {'yes' if status['running'] else 'no'}")
    policy = status["policy"]
    if policy is not None:
        verdict = "allows training" if policy["allowed"] else "paused: " + "; ".join(policy["reasons"])
        unknown = f" (unknown: {', '.join(policy['unknown'])})" if policy["unknown"] else ""
        print(f"policy:    {verdict}{unknown}")
    if status["last_pause"] is not None:
        print(f"last pause: {status['last_pause']['reason']}")


def main(args: argparse.Namespace) -> int:
    if args.action == "add":  # the store alone: adding examples never loads torch
        from edgetrain.personalise import Store

        examples = read_examples(args.files, args.format)
        with Store(args.store) as store:
            for example_id in (store.add_retain if args.retain else store.add_many)(examples):
                print(example_id)
        return 0
    from edgetrain.personalise import Personaliser

    if args.action == "status":
        return _status(args)
    if args.action == "forget":
        with Personaliser(args.store) as personaliser:
            result = personaliser.forget(args.ids)
        for example_id in result["forgotten"]:
            print(example_id)
        if result["stale"]:
            print(f"stale now (they saw these examples): versions {', '.join(map(str, result['stale']))}",
                  file=sys.stderr)
        if result["unknown"]:
            print(f"edgetrain personalise forget: not in the store: {', '.join(result['unknown'])}", file=sys.stderr)
            return 2
        return 0
    if args.action == "rollback":
        with Personaliser(args.store) as personaliser:
            target = personaliser.rollback()
        print("serving the base model" if target is None else f"serving version {target}")
        return 0
    return _run(args)


def _status(args: argparse.Namespace) -> int:
    from edgetrain.personalise import Personaliser

    rows = None
    if args.plot is not None:
        from edgetrain.personalise.history import require_history
        from edgetrain.personalise.plot import plot_format

        # Refused before anything is printed: a wrong suffix, no matplotlib, or a store with no gate yet.
        plot_format(args.plot)
        rows = require_history(args.store)
    with Personaliser(args.store) as personaliser:
        status = personaliser.status()
    if rows is not None:
        from edgetrain.personalise.plot import plot_history, summary

        kind = {"lm": "decoder", "classify": "classifier"}.get(status["kind"], "no model yet")
        plot_history(rows, args.plot, title=f"{status['model'] or 'the store'} ({kind}), {status['store']}")
    if args.json:
        print(json.dumps(status, default=str))  # one JSON object, with or without --plot
    else:
        _print_status(status)
        if rows is not None:
            print(f"plot:      {args.plot} ({summary(rows)})")
    return 0


def _run(args: argparse.Namespace) -> int:
    from edgetrain.personalise import Personaliser, Policy
    from edgetrain.personalise.errors import PersonaliseError

    if args.max_steps is not None and args.max_steps < 0:
        raise PersonaliseError(f"--max-steps {args.max_steps}: must be >= 0")
    policy = Policy(require_power=args.require_power, max_temp_c=args.max_temp,
                    min_free_bytes=0 if args.min_free_mb is None else int(args.min_free_mb * 2**20),
                    unknown=args.unknown)
    template = None
    if args.chat_template is not None:
        template = Path(args.chat_template).read_text(encoding="utf-8")
    prompts = None
    if args.retain_prompts is not None:
        prompts = [line.strip() for line in Path(args.retain_prompts).read_text(encoding="utf-8").splitlines()
                   if line.strip()]
    with Personaliser(args.store, args.model, method=args.method, backend=args.backend, rank=args.rank,
                      lr=args.lr, batch_size=args.batch, seq_len=args.seq, window_steps=args.window_steps,
                      checkpoint_every=args.checkpoint_every, keep_versions=args.keep, margin=args.margin,
                      holdout_every=args.holdout_every, policy=policy, chat_template=template,
                      on_event=_event_logger(), load=LoadOptions.asked_for(args),
                      threads=args.threads, retain_margin=None if args.no_guard else args.retain_margin,
                      replay=args.replay, retain_prompts=prompts) as personaliser:
        result = personaliser.run(max_steps=args.max_steps, max_seconds=args.max_seconds, wait=args.wait)
        served = personaliser.served_version()
    print(json.dumps({"steps": result.steps, "windows": result.windows, "promoted": result.promoted,
                      "rejected": result.rejected, "ended": result.reason,
                      "served": "base" if served is None else served.version}))
    return 0
