#!/usr/bin/env python3
"""The whole footprint of a training step with the frozen base in 4 bits on torch, side by side in one run.

Each arm is `edgetrain profile`'s worker in a fresh process (edgetrain.profiler.runner), reading the OS
probe: the footprint is what the process holds above torch's runtime (torch, its optimizer machinery and
edgetrain imported, nothing built; file-backed pages left out) plus the step's peak above that. Arms:

  mesp, fp32 base      the decoder's block projections dense in float32
  mesp, 4-bit base     quantised on load to 4 bits (embedding and head too; groups of 64), dequantised
                       a tile at a time
  mebp, fp32 base      autograd with per-block checkpointing, the MeSP paper's baseline

plus, with --gguf (SmolLM2-135M by default), mesp on that GGUF at --gguf-seq x --gguf-batch (128 x 2) with its
4- and 8-bit matrices kept as stored (the default since LoadOptions), with --dequantize, and kept with
LEAN_CHUNKS: the step time of the packed base over the dequantised one's is printed.

User paths (with --gguf, unless --no-user-paths): the peak resident set of `edgetrain train --method mesp`,
`edgetrain eval` and `edgetrain personalise run` on that GGUF with default flags and with --dequantize, each in
a fresh process (edgetrain.profiler.command_peak), above the floor of the same interpreter with torch and
edgetrain imported, and above the runtime floor (that plus torch._dynamo, which the first torch optimizer
imports: what `edgetrain profile` calls torch's runtime).
The floor is edgetrain's analytic step memory (edgetrain/training/step_estimates.py: stored block inputs, one
block's working set or one loss tile, the dequantised matrix, the block's gradients); peak/floor is the
probe's step peak over it.

  .venv/bin/python tools/bench_quantized.py --steps 3            # Qwen2.5-0.5B's shape, seq 256, LoRA r8
  .venv/bin/python tools/bench_quantized.py --model tiny --quick # a smoke run
  python3 tools/bench_quantized.py --backend torch-cuda --warmup 5 --gguf ''   # on a CUDA GPU

The arms run in edgetrain.profiler.bench's protocol (rounds in alternating order, --repeats of them,
median and spread, ratios to the fp32-base mesp arm); --json writes each arm's last worker record.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from edgetrain.profiler.bench import Arm, Column, format_table, measure_interleaved, summarise, write_png
from edgetrain.profiler.config import ProfileConfig
from edgetrain.profiler.runner import run_isolated

MIB = 2**20
BASELINE = "mesp, fp32 base"
# MeSP's chunk options for the leanest step a device would choose (smaller working set, slower step).
LEAN_CHUNKS = {"attention_chunk": 32, "mlp_chunk": 64, "loss_chunk": 64}
COLUMNS = [Column("weights_bytes", "weights", MIB, "MiB"), Column("footprint_bytes", "footprint", MIB, "MiB"),
           Column("peak_bytes_probe", "step peak", MIB, "MiB"), Column("estimate_bytes", "floor", MIB, "MiB"),
           Column("peak_over_floor", "peak/floor"), Column("step_seconds", "step", 1.0, "s")]


def arms(args: argparse.Namespace) -> list[tuple[str, ProfileConfig]]:
    common = dict(model=args.model, backend=args.backend, seq=args.seq, rank=8, steps=args.steps,
                  warmup=args.warmup, layers=args.layers, fidelity=False)
    chosen = [(BASELINE, ProfileConfig(method="mesp", **common)),
              ("mesp, 4-bit base", ProfileConfig(method="mesp", quantize_bits=4, **common)),
              ("mebp, fp32 base", ProfileConfig(method="mebp", **common))]
    if args.gguf:
        for label, options, dequantize in ((gguf_arm(args, "packed"), {}, False),
                                           (gguf_arm(args, "dequantised"), {}, True),
                                           (gguf_arm(args, "packed, lean chunks"), LEAN_CHUNKS, False)):
            chosen.append((label, ProfileConfig(
                method="mesp", model=args.gguf, backend=args.backend, seq=args.gguf_seq, batch=args.gguf_batch,
                rank=8, steps=args.steps, warmup=args.warmup, fidelity=False, dequantize=dequantize,
                method_options=options)))
    return chosen


def gguf_arm(args: argparse.Namespace, base: str) -> str:
    return f"mesp, {args.gguf} {base}, seq {args.gguf_seq} x {args.gguf_batch}"


def _arm(name: str, config: ProfileConfig, records: dict[str, dict]) -> Arm:
    """One fresh worker process per run; its record is kept, its figures are the sample."""
    def run() -> dict[str, float | None]:
        record = run_isolated(config)
        records[name] = record
        floor = record.get("estimate_bytes")
        peak_over_floor = record["peak_bytes_probe"] / floor if floor and record.get("peak_bytes_probe") else None
        return {**{column.metric: record.get(column.metric) for column in COLUMNS},
                "peak_over_floor": peak_over_floor}
    return Arm(name, run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--backend", default="torch-cpu", help="torch-cpu or torch-cuda")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps in each worker before the timed ones "
                                                              "(a GPU wants several)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every arm (alternating order)")
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N blocks")
    parser.add_argument("--gguf", default="smollm2-135m", help="a GGUF model to train with its blocks as stored "
                                                               "('' to skip)")
    parser.add_argument("--gguf-seq", type=int, default=128, help="sequence length of the GGUF arms")
    parser.add_argument("--gguf-batch", type=int, default=2, help="batch of the GGUF arms")
    parser.add_argument("--no-user-paths", action="store_true",
                        help="skip the peaks of edgetrain train / eval / personalise run on the GGUF")
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 step, no GGUF arm")
    parser.add_argument("--json", default=None, help="write each arm's last worker record here")
    parser.add_argument("--png", default=None, help="a chart of the footprint ratios")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.steps, args.gguf = "tiny", 1, ""
    records: dict[str, dict] = {}
    samples = measure_interleaved([_arm(name, config, records) for name, config in arms(args)],
                                  repeats=args.repeats, warmup=0, description="bench_quantized")
    summaries = {arm: summarise(taken) for arm, taken in samples.items()}
    runtime = records[BASELINE]["runtime_baseline_bytes"]
    print(format_table(f"{args.model}, seq {args.seq}, LoRA r8, {args.backend}; footprint = held above torch's runtime "
                       f"({runtime / MIB:.0f} MiB) + the step's peak; floor = the analytic step memory",
                       summaries, BASELINE, COLUMNS))
    mebp = summaries["mebp, fp32 base"]["footprint_bytes"].median
    four = summaries["mesp, 4-bit base"]["footprint_bytes"].median
    print(f"mesp 4-bit base / mebp fp32 base: {four / mebp:.2f}x footprint")
    if args.gguf:
        packed = summaries[gguf_arm(args, "packed")]["step_seconds"].median
        dense = summaries[gguf_arm(args, "dequantised")]["step_seconds"].median
        print(f"{args.gguf}, mesp seq {args.gguf_seq} x {args.gguf_batch}: packed base / dequantised base step time "
              f"{packed / dense:.2f}x")
        if not args.no_user_paths:
            from user_path_peaks import print_user_path_peaks

            print_user_path_peaks(args.gguf, repeats=args.repeats)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(records, handle, indent=1)
    if args.png:
        write_png(args.png, summaries, BASELINE, COLUMNS[1], title="footprint, ratio to mesp with an fp32 base")
    return 0


if __name__ == "__main__":
    sys.exit(main())
