#!/usr/bin/env python3
"""Training beside a busy app: a `mesp` LoRA step on the quiet machine, and beside another process that
keeps one core busy, with the thread count fixed at every core (torch's default) and with
`threads="auto"` (edgetrain.training.threads); the quiet step on one core fewer (what the busy core leaves:
the floor); and the personaliser's run beside the same load against a bare loop of the same steps. Interleaved rounds (edgetrain.profiler.bench), ratios from one run.

  .venv/bin/python tools/bench_busy_core.py                  # the tiny preset, 12 steps an arm, 3 rounds
  .venv/bin/python tools/bench_busy_core.py --model smollm2-135m --steps 4

`--cli` times the path a user takes instead: whole `edgetrain train` processes (the command's own defaults
but for --model, --method, --steps, --seq and --batch), quiet and beside the busy core, with --threads fixed
at torch's own count (what a fresh process gets; the command's default before `auto`), with --threads auto,
and with no --threads at all (whatever the default is now). s/step is the mean of the step times each run
logs (--log-jsonl) past its first step; wall is the whole process, model loading included.

  .venv/bin/python tools/bench_busy_core.py --cli --steps 30            # tiny, mebp (the command's default)
  .venv/bin/python tools/bench_busy_core.py --cli --model smollm2-135m --method mesp --seq 128 --batch 2 --steps 6

`--bits` says what a thread count does to the numbers (what a resumed `auto` run can promise): the same
--steps of --method (default mesp) on the same batches, once on 1 thread and once on every usable core, and how
many trainable tensors then differ, bit for bit, and by how much. No timing.

  .venv/bin/python tools/bench_busy_core.py --bits --steps 5 --method mebp

The busy core is `python -c "while True: pass"`, not pinned: the OS places it, as it places an app. The
learner loops run without a memory probe, as the personaliser's learners do.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Sequence

import torch

import edgetrain
from edgetrain.data.batch import Batch
from edgetrain.profiler.bench import Arm, measure_interleaved, summarise
from edgetrain.training.threads import usable_cores


@contextlib.contextmanager
def busy_core() -> Iterator[None]:
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)  # let it take its core
        yield
    finally:
        spinner.kill()
        spinner.wait()


def batches(model, seq: int, batch: int) -> Iterator[Batch]:
    generator = torch.Generator().manual_seed(0)
    index = 0
    while True:
        tokens = torch.randint(0, model.config.vocab_size, (batch, seq), generator=generator)
        yield Batch(tokens, tokens, index)
        index += 1


def learner_arm(args: argparse.Namespace, threads, busy: bool):
    model = edgetrain.load_model(args.model)
    edgetrain.add_lora(model, rank=8, alpha=16.0)
    # No memory probe, as the personaliser's learners have none: its per-step heap work is not what is timed.
    learner = edgetrain.Learner(model, method="mesp", optimizer="adamw", lr=1e-3, threads=threads, probe=False)
    stream = batches(model, args.seq, args.batch)

    def run() -> dict:
        with busy_core() if busy else contextlib.nullcontext():
            start = time.perf_counter()
            used = [learner.step(next(stream)).threads for _ in range(args.steps)]
            seconds = (time.perf_counter() - start) / args.steps
        return {"seconds_per_step": seconds, "threads": sum(used) / len(used)}
    return run


def trained_on(args: argparse.Namespace, threads: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The trainable tensors and losses after --steps steps on `threads` threads, from the same seed and batches."""
    torch.manual_seed(0)
    model = edgetrain.load_model(args.model)
    edgetrain.add_lora(model, rank=8, alpha=16.0)
    learner = edgetrain.Learner(model, method=args.method or "mesp", optimizer="adamw", lr=1e-3, threads=threads,
                                probe=False)
    stream = batches(model, args.seq, args.batch)
    losses = [learner.step(next(stream)).loss for _ in range(args.steps)]
    return {name: value.detach().clone() for name, value in learner.params.items()}, losses


def bits_main(args: argparse.Namespace, cores: int) -> int:
    """--bits: 1 thread against every core, tensor by tensor."""
    one, one_losses = trained_on(args, 1)
    every, every_losses = trained_on(args, cores)
    differ = [name for name in one if not torch.equal(one[name], every[name])]
    largest = max((one[name] - every[name]).abs().max().item() for name in one)
    print(f"{args.model}, {args.method or 'mesp'}, seq {args.seq} x batch {args.batch}, {args.steps} steps, 1 thread "
          f"against {cores}: {len(differ)} of {len(one)} trainable tensors differ (largest difference {largest:.3g}); "
          f"losses {'equal' if one_losses == every_losses else 'differ'} "
          f"(last {one_losses[-1]:.9g} against {every_losses[-1]:.9g})")
    return 0


def cli_arm(args: argparse.Namespace, threads: str | None, busy: bool, scratch: Path):
    """One `edgetrain train` process a run: per-step seconds from its own step log, and its wall time."""
    log = scratch / f"{'busy' if busy else 'quiet'}-{threads or 'default'}.jsonl"
    command = [sys.executable, "-m", "edgetrain.cli", "train", "--model", args.model, "--steps", str(args.steps),
               "--seq", str(args.seq), "--batch", str(args.batch), "--quiet", "--log-jsonl", str(log)]
    command += ["--method", args.method] if args.method else []
    command += ["--threads", threads] if threads is not None else []

    def run() -> dict:
        log.unlink(missing_ok=True)
        with busy_core() if busy else contextlib.nullcontext():
            start = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True)
            wall = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
        # Step 1 pays for first-touch allocations and thread pools: not what a long run's steps cost.
        steps = [json.loads(line) for line in log.read_text().splitlines()][1:]
        counts = [step["threads"] for step in steps if step["threads"] is not None]
        return {"seconds_per_step": statistics.fmean(step["seconds"] for step in steps), "wall": wall,
                "threads": statistics.fmean(counts) if counts else None}
    return run


def cli_main(args: argparse.Namespace, cores: int) -> int:
    """--cli: the arms, their rounds and the table (ratios to the quiet fixed run and to auto beside it)."""
    own = str(torch.get_num_threads())  # this process never set it: what a fresh `edgetrain train` gets
    loads = {"quiet": False, "busy core": True}
    settings = {f"--threads {own} (torch's)": own, "--threads auto": "auto", "no --threads": None}
    with tempfile.TemporaryDirectory() as scratch:
        arms = [Arm(f"{load}, {label}", cli_arm(args, threads, busy, Path(scratch)))
                for load, busy in loads.items() for label, threads in settings.items()]
        samples = measure_interleaved(arms, repeats=args.repeats, warmup=args.warmup, description="edgetrain train")
    summaries = {name: summarise(taken) for name, taken in samples.items()}
    quiet = summaries[arms[0].name]["seconds_per_step"].median
    print(f"\nedgetrain train --model {args.model} --method {args.method or '(default)'} --seq {args.seq} --batch "
          f"{args.batch} --steps {args.steps}, {cores} usable cores, median of {args.repeats} rounds; s/step: mean "
          f"of steps 2-{args.steps} of a run; / quiet: to the quiet --threads {own}; / auto: to --threads auto "
          "under the same load; spread = (high - low) / median of s/step")
    print(f"{'arm':<38}{'s/step':>9}{'threads':>9}{'/ quiet':>9}{'/ auto':>8}{'wall s':>9}{'spread':>8}")
    for arm in arms:
        taken = summaries[arm.name]
        seconds = taken["seconds_per_step"]
        auto = summaries[f"{arm.name.split(',')[0]}, --threads auto"]["seconds_per_step"].median
        threads = f"{taken['threads'].median:.1f}" if "threads" in taken else "torch"
        print(f"{arm.name:<38}{seconds.median:>9.3f}{threads:>9}{seconds.median / quiet:>8.2f}x"
              f"{seconds.median / auto:>7.2f}x{taken['wall'].median:>9.1f}{seconds.spread:>8.2f}")
    return 0


def personaliser_arm(args: argparse.Namespace, root: Path):
    from pydoc_data.topics import topics

    personaliser = edgetrain.Personaliser(root / "store", args.model, method="mesp", rank=8, batch_size=args.batch,
                                          seq_len=args.seq, window_steps=10**6, checkpoint_every=10**6)
    personaliser.add_many([topics[key] for key in sorted(topics)[:60]])
    personaliser.run(max_steps=1)  # loads the model and opens the window outside the timed rounds

    def run() -> dict:
        with busy_core():
            start = time.perf_counter()
            result = personaliser.run(max_steps=args.steps)
            seconds = (time.perf_counter() - start) / max(1, result.steps)
        if result.steps != args.steps:
            raise SystemExit(f"the personaliser took {result.steps} steps, not {args.steps} ({result.reason})")
        return {"seconds_per_step": seconds}
    return run, personaliser


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=12, help="steps an arm takes in each round")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds before the timed ones")
    parser.add_argument("--cli", action="store_true", help="time `edgetrain train` processes (see above)")
    parser.add_argument("--method", default=None,
                        help="--cli: the command's --method (default: its own); --bits: default mesp")
    parser.add_argument("--bits", action="store_true", help="1 thread against every core, bit for bit (see above)")
    args = parser.parse_args(argv)
    cores = usable_cores()
    if cores < 2:
        raise SystemExit("this benchmark needs at least 2 usable cores (one is kept busy)")
    if args.cli:
        return cli_main(args, cores)
    if args.bits:
        return bits_main(args, cores)
    if args.method is not None:
        raise SystemExit("--method is for --cli and --bits (the learner loops run mesp)")
    with tempfile.TemporaryDirectory() as scratch:
        personalised, personaliser = personaliser_arm(args, Path(scratch))
        arms = [Arm(f"quiet, {cores} threads", learner_arm(args, cores, busy=False)),
                # the floor beside a busy core: the step on one core fewer, with the machine to itself
                Arm(f"quiet, {cores - 1} thread(s)", learner_arm(args, cores - 1, busy=False)),
                Arm(f"busy core, {cores} threads", learner_arm(args, cores, busy=True)),
                Arm("busy core, threads=auto", learner_arm(args, "auto", busy=True)),
                Arm("busy core, personaliser (auto)", personalised)]
        samples = measure_interleaved(arms, repeats=args.repeats, warmup=args.warmup, description="busy core")
        personaliser.close()
    summaries = {name: summarise(taken) for name, taken in samples.items()}
    quiet = summaries[arms[0].name]["seconds_per_step"].median
    auto = summaries[arms[3].name]["seconds_per_step"].median
    print(f"\n{args.model}, mesp, seq {args.seq} x batch {args.batch}, {cores} usable cores, {args.steps} steps an "
          f"arm, median of {args.repeats} rounds (spread = (high - low) / median)")
    print(f"{'arm':<34}{'s/step':>9}{'threads':>9}{'/ quiet':>9}{'/ auto':>8}{'spread':>8}")
    for arm in arms:
        taken = summaries[arm.name]
        seconds = taken["seconds_per_step"]
        threads = f"{taken['threads'].median:.1f}" if "threads" in taken else "auto"
        print(f"{arm.name:<34}{seconds.median:>9.3f}{threads:>9}{seconds.median / quiet:>8.2f}x"
              f"{seconds.median / auto:>7.2f}x{seconds.spread:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
