#!/usr/bin/env python3
"""The same model in different GGUF types, side by side in one run: a MeSP step on each file with its
matrices kept packed (the default), and the peak resident set of the user paths on it, as ratios to the
first file.

Arms, each a fresh process, in edgetrain.profiler.bench's protocol (rounds in alternating order,
--repeats of them, median and spread):
  mesp, FILE          `edgetrain profile`'s worker (edgetrain.profiler.runner): step time, its compute floor
                      (s/floor: the step's matrix products timed alone), footprint, resident weights
  PATH, FILE          the peak resident set of `edgetrain train --method mesp`, `edgetrain eval` and
                      `edgetrain personalise run` with default flags (tools/user_path_peaks.py's commands),
                      above the import floor

  .venv/bin/python tools/bench_gguf_types.py smollm2-135m smollm2-q4_k_m.gguf     # Q4_1 as downloaded, and
                                                              # the Q4_K_M tools/requantize_gguf.py makes of it
  --torch-kernels: each file's step also with torch's dequantisation instead of the compiled tile kernel
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from edgetrain.models import tile_kernel
from edgetrain.profiler.bench import Arm, measure_interleaved, summarise
from edgetrain.profiler.command_peak import peak_rss_of_command
from edgetrain.profiler.config import ProfileConfig
from edgetrain.profiler.runner import run_isolated

MIB = 2**20
STEP_METRICS = ("step_seconds", "floor_ratio", "footprint_bytes", "weights_bytes")


def _step_arm(name: str, model: str, args: argparse.Namespace, torch_kernels: bool = False) -> Arm:
    """`torch_kernels`: the worker dequantises with torch's kernels, not the compiled tile kernel."""
    config = ProfileConfig(method="mesp", model=model, seq=args.seq, batch=args.batch, rank=8, steps=args.steps,
                           warmup=args.warmup, fidelity=False, threads=args.threads)

    def run() -> dict[str, float | None]:
        saved = os.environ.get(tile_kernel.ENVIRONMENT_SWITCH)
        if torch_kernels:
            os.environ[tile_kernel.ENVIRONMENT_SWITCH] = "off"  # the worker process reads it
        try:
            record = run_isolated(config)
        finally:
            if saved is None:
                os.environ.pop(tile_kernel.ENVIRONMENT_SWITCH, None)
            else:
                os.environ[tile_kernel.ENVIRONMENT_SWITCH] = saved
        return {metric: record.get(metric) for metric in STEP_METRICS}
    return Arm(name, run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="GGUF files (or download names); ratios are to the first")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--no-user-paths", action="store_true", help="the mesp steps only")
    parser.add_argument("--threads", type=int, default=None,
                        help="the steps' intra-op threads (default: torch's own count, as a user's run)")
    parser.add_argument("--torch-kernels", action="store_true",
                        help="also each file's mesp step dequantised by torch's kernels (EDGETRAIN_TILE_KERNEL=off)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from user_path_peaks import IMPORT_FLOOR, commands, write_text

    labels = [Path(model).name for model in args.models]
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        text = write_text(directory)
        arms = [_step_arm(f"mesp, {label}", model, args) for label, model in zip(labels, args.models)]
        step_rows = list(labels)
        if args.torch_kernels:
            step_rows += [f"{label} (torch kernels)" for label in labels]
            arms += [_step_arm(f"mesp, {label} (torch kernels)", model, args, torch_kernels=True)
                     for label, model in zip(labels, args.models)]
        paths: list[str] = []
        if not args.no_user_paths:
            arms.append(Arm(IMPORT_FLOOR, lambda: {"peak": peak_rss_of_command([])}))
            for label, model in zip(labels, args.models):
                for path, command in commands(model, text, directory).items():
                    paths.append(path) if path not in paths else None
                    arms.append(Arm(f"{path}, {label}", lambda command=command: {"peak": peak_rss_of_command(command())}))
        samples = measure_interleaved(arms, repeats=args.repeats, warmup=0, description="bench_gguf_types")
    summaries = {name: summarise(taken) for name, taken in samples.items()}
    first = labels[0]
    threads = "torch's own thread count" if args.threads is None else f"{args.threads} thread(s)"
    print(f"\nmesp, seq {args.seq} x batch {args.batch}, LoRA r8, {args.steps} steps after {args.warmup}, {threads}; "
          f"median of {args.repeats}; ratios to {first}")
    print(f"dequantising: {tile_kernel.status()} (the rows marked torch kernels: {tile_kernel.ENVIRONMENT_SWITCH}=off)")
    print(f"{'file':<50}{'s/step':>9}{'ratio':>8}{'s/floor':>9}{'weights MiB':>13}{'footprint MiB':>15}{'ratio':>8}")
    base = summaries[f"mesp, {first}"]
    for label in step_rows:
        row = summaries[f"mesp, {label}"]
        step, floor_ratio = row["step_seconds"].median, row["floor_ratio"].median
        footprint, weights = row["footprint_bytes"].median, row["weights_bytes"].median
        print(f"{label:<50}{step:>9.3f}{step / base['step_seconds'].median:>7.2f}x{floor_ratio:>8.2f}x"
              f"{weights / MIB:>13.1f}{footprint / MIB:>15.0f}{footprint / base['footprint_bytes'].median:>7.2f}x")
    if paths:
        floor = summaries[IMPORT_FLOOR]["peak"].median
        print(f"\npeak resident set above the import floor ({floor / MIB:.0f} MiB), MiB, default flags; ratio to {first}")
        print(f"{'command':<28}" + "".join(f"{label[:22]:>24}" for label in labels))
        for path in paths:
            peaks = [summaries[f"{path}, {label}"]["peak"].median - floor for label in labels]
            print(f"{path:<28}" + "".join(f"{peak / MIB:>14.0f} ({peak / peaks[0]:.2f}x)" for peak in peaks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
