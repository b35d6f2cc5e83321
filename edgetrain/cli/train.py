"""Train on a local stream with checkpoints that survive the process being killed.

Run it again with the same --checkpoint-dir and it resumes from the newest checkpoint that passes its
checksum, at the same stream position, RNG state and method seeds: a run killed at any moment and
resumed reaches the same weights, bit for bit, as one that was never interrupted and took each step on the
same number of threads. --threads N fixes that number; the default, auto, fits it between steps to the cores
other processes leave free (beside one busy core a step on every core took 3.5-4x as long,
docs/benchmarks.md), so each checkpoint records the counts its steps ran on, and a resumed run whose counts
were not all one says so in one log line.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
from typing import Callable

from edgetrain.backends.load_options import LoadOptions, add_load_flags
from edgetrain.training.threads import ThreadFitter, threads_flag


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default="tiny",
                        help="preset, pretrained name (edgetrain list models), checkpoint directory or .gguf file")
    parser.add_argument("--method", default="mebp")
    parser.add_argument("--backend", default="torch-cpu")
    add_load_flags(parser)
    parser.add_argument("--data", default="text", help="stream name: text, digits, fashion-mnist")
    parser.add_argument("--files", nargs="*", default=None,
                        help="text stream: text (*.txt) or JSONL (*.jsonl) files, or directories of them")
    parser.add_argument("--seq", type=int, default=64, help="sequence length (text)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (language models)")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=100, help="total steps, resumed ones included")
    parser.add_argument("--lr-schedule", default=None, help="constant (default), linear-warmup, linear or cosine")
    parser.add_argument("--schedule-option", action="append", default=[], metavar="KEY=JSON",
                        help="a schedule option, e.g. warmup_steps=10 or total_steps=200 (repeatable)")
    parser.add_argument("--accumulate", type=int, default=1, metavar="N",
                        help="cut each batch into N micro-batches and sum their gradients into one update "
                             "(bp, mebp, mesp)")
    parser.add_argument("--max-grad-norm", type=float, default=None, metavar="X",
                        help="clip each update to a global L2 norm of X (bp, mebp, mesp)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", default="auto", type=threads_flag, metavar="N|auto",
                        help="intra-op threads. auto (default): torch's own count, less the cores other processes "
                             "keep busy, checked between steps; a killed run resumes bit for bit where its steps "
                             "took the same counts as the uninterrupted run (each checkpoint records them). N: "
                             "always N; a killed run resumes bit for bit")
    parser.add_argument("--method-option", action="append", default=[], metavar="KEY=JSON",
                        help="an option of the method, e.g. epsilon=0.001 (repeatable)")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--memory-budget", default=None, help="e.g. 512MiB: refuse a first step over it")
    parser.add_argument("--target", default=None, help="device profile from targets/ (its memory budget)")
    parser.add_argument("--save-adapter", default=None,
                        help="write the LoRA adapter here at the end: a path ending in .safetensors gets "
                             "edgetrain's one file on any backend, another path the backend's own format "
                             "(torch: the same file; mlx: an mlx-lm adapter directory)")
    parser.add_argument("--allow-data-change", action="store_true",
                        help="resume a checkpoint on other data than it was trained on (refused otherwise)")
    parser.add_argument("--log-jsonl", default=None, metavar="FILE",
                        help="append one JSON line of step statistics per step (a resumed run goes on appending)")
    return parser


def jsonl_step_logger(path: str) -> Callable:
    """A fit callback appending one JSON line per step to `path`. Each line is one write(2) to a file
    opened for appending, so a process killed between steps leaves whole lines."""
    from dataclasses import asdict

    def log(learner, stats) -> None:
        line = json.dumps({**asdict(stats), "method": learner.method_name}) + "\n"
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(descriptor, line.encode("utf-8"))
        finally:
            os.close(descriptor)
    return log


def _method_options(pairs: list[str], flag: str = "--method-option") -> dict:
    from edgetrain.registry import EdgetrainError

    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise EdgetrainError(f"{flag} {pair!r}: expected KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def _one_file(path: str) -> bool:
    return str(path).endswith(".safetensors")


def _check_outputs(args: argparse.Namespace, backend) -> None:
    """Refuse, before any work, a run whose checkpoints or adapter could not be written."""
    from edgetrain.registry import EdgetrainError
    from edgetrain.training.checkpoint import ensure_writable_directory, ensure_writable_target

    if args.checkpoint_dir is not None:
        if args.checkpoint_every < 1:
            raise EdgetrainError(f"--checkpoint-every {args.checkpoint_every}: must be at least 1 with "
                                 "--checkpoint-dir (0 would never write a checkpoint)")
        ensure_writable_directory(args.checkpoint_dir, "--checkpoint-dir")
    if args.save_adapter is not None:
        # A .safetensors path is edgetrain's one file on any backend; another path the backend's own
        # format (MLX: an mlx-lm adapter directory).
        ensure_writable_target(args.save_adapter, "--save-adapter",
                               directory=backend.adapter_is_directory and not _one_file(args.save_adapter))
    if args.log_jsonl is not None:
        log = ensure_writable_target(args.log_jsonl, "--log-jsonl")
        if log.exists() and not os.access(log, os.W_OK):
            raise EdgetrainError(f"--log-jsonl {log} exists and cannot be written")


@functools.cache
def _torch_own_threads() -> int:
    """torch's intra-op thread count before this process changed it (physical cores, or OMP_NUM_THREADS)."""
    import torch

    return torch.get_num_threads()


def learner_threads(setting: int | str) -> int | ThreadFitter:
    """--threads as the learner takes it. auto never goes above torch's own count, so on a quiet machine every
    step runs on the count a run took before auto was the default (and OMP_NUM_THREADS still caps it)."""
    return ThreadFitter(max_threads=_torch_own_threads()) if setting == "auto" else setting


def _note_step(learner, stats) -> None:
    """Between fit's step lines (every 10 steps), a heartbeat line says which step is done."""
    from edgetrain.utils.progress import note_stage

    note_stage(f"step {stats.step} done, loss {stats.loss:.4f}")


def main(args: argparse.Namespace) -> int:
    import torch

    # The learner sets torch's (process-wide) thread count before each step: a caller that runs this command
    # in its own process (tests, an app) gets its own count back.
    saved = torch.get_num_threads()
    try:
        return _train(args)
    finally:
        torch.set_num_threads(saved)


def _train(args: argparse.Namespace) -> int:
    import torch

    import edgetrain
    from edgetrain.backends import get_backend
    from edgetrain.data import make_stream
    from edgetrain.utils.logs import get_logger
    from edgetrain.utils.progress import begin_stage

    torch.manual_seed(args.seed)
    backend = get_backend(args.backend)
    _check_outputs(args, backend)
    add_lora, save_adapter = backend.adapter_functions()
    begin_stage(f"loading {args.model}")  # a pretrained name is fetched first, once: a 93 MB download
    model = edgetrain.load_model(args.model, backend=args.backend, options=LoadOptions.from_args(args))
    stream_options = {"batch_size": args.batch, "seed": args.seed}
    if getattr(model, "task", None) == "lm":
        from edgetrain.data.tokenizer import model_tokenizer

        add_lora(model, rank=args.rank)
        stream_options.update(seq_len=args.seq, vocab_size=model.config.vocab_size,
                              tokenizer=model_tokenizer(model))
        if args.files:
            stream_options["paths"] = args.files
    learner = edgetrain.Learner(model, method=args.method, backend=args.backend, optimizer=args.optimizer,
                                lr=args.lr, method_options=_method_options(args.method_option), seed=args.seed,
                                memory_budget=args.memory_budget, target=args.target,
                                lr_schedule=args.lr_schedule,
                                schedule_options=_method_options(args.schedule_option, "--schedule-option") or None,
                                accumulate=args.accumulate, max_grad_norm=args.max_grad_norm,
                                threads=learner_threads(args.threads))
    if args.checkpoint_dir:
        resumed = learner.resume(args.checkpoint_dir)
        if resumed is not None:
            get_logger(__name__).info("resumed from %s (step %d)", resumed, learner.steps_done)
    stream = make_stream(args.data, start_index=learner.stream_position, **stream_options)
    begin_stage(f"training {args.method} to step {args.steps}")
    learner.fit(stream, max_steps=args.steps, checkpoint_every=args.checkpoint_every if args.checkpoint_dir else 0,
                checkpoint_dir=args.checkpoint_dir, progress=not args.quiet,
                allow_data_change=args.allow_data_change,
                callbacks=[_note_step, *([jsonl_step_logger(args.log_jsonl)] if args.log_jsonl else [])])
    if args.checkpoint_dir and learner.steps_done % max(args.checkpoint_every, 1):
        learner.save_rotating(args.checkpoint_dir)
    if args.save_adapter:
        if _one_file(args.save_adapter):
            edgetrain.save_lora(model, args.save_adapter)
        else:
            save_adapter(model, args.save_adapter)
    print(json.dumps({"steps_done": learner.steps_done, "stream_position": learner.stream_position}))
    return 0
