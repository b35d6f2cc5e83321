#!/usr/bin/env python3
"""Training beside a busy app: a `mesp` LoRA step on the quiet machine, and beside another process that
keeps one core busy, with the thread count fixed at every core (torch's default) and with
`threads="auto"` (edgetrain.training.threads); the quiet step on one core fewer (what the busy core leaves:
the floor); and the personaliser's run beside the same load against a bare loop of the same steps. Interleaved rounds (edgetrain.profiler.bench), ratios from one run.

  .venv/bin/python tools/bench_busy_core.py                  # the tiny preset, 12 steps an arm, 3 rounds
  .venv/bin/python tools/bench_busy_core.py --model smollm2-135m --steps 4

The busy core is `python -c "while True: pass"`, not pinned: the OS places it, as it places an app. The
learner loops run without a memory probe, as the personaliser's learners do.
"""
from __future__ import annotations

import argparse
import contextlib
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
    args = parser.parse_args(argv)
    cores = usable_cores()
    if cores < 2:
        raise SystemExit("this benchmark needs at least 2 usable cores (one is kept busy)")
    with tempfile.TemporaryDirectory() as scratch:
        personalised, personaliser = personaliser_arm(args, Path(scratch))
        arms = [Arm(f"quiet, {cores} threads", learner_arm(args, cores, busy=False)),
                # the floor beside a busy core: the step on one core fewer, with the machine to itself
                Arm(f"quiet, {cores - 1} thread(s)", learner_arm(args, cores - 1, busy=False)),
                Arm(f"busy core, {cores} threads", learner_arm(args, cores, busy=True)),
                Arm("busy core, threads=auto", learner_arm(args, "auto", busy=True)),
                Arm("busy core, personaliser (auto)", personalised)]
        samples = measure_interleaved(arms, repeats=args.repeats, warmup=1, description="busy core")
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
