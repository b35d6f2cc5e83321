#!/usr/bin/env python3
"""The whole footprint of a training step with the frozen base in 4 bits on torch, side by side in one run.

Each arm is `edgetrain profile`'s worker in a fresh process (edgetrain.profiler.runner), reading the OS
probe: the footprint is what the process holds above torch's runtime (torch, its optimizer machinery and
edgetrain imported, nothing built; file-backed pages left out) plus the step's peak above that. Arms:

  mesp, fp32 base      the decoder's block projections dense in float32
  mesp, 4-bit base     quantised on load to 4 bits (groups of 32), dequantised one layer at a time
  mebp, fp32 base      autograd with per-block checkpointing, the MeSP paper's baseline

plus, with --gguf (SmolLM2-135M by default), mesp on that GGUF with its Q4_1 blocks kept as stored.
The floor is edgetrain's analytic step memory (edgetrain/step_estimates.py: stored block inputs, one
block's working set or one loss tile, the dequantised matrix, the block's gradients); peak/floor is the
probe's step peak over it.

  .venv/bin/python tools/bench_quantized.py                      # Qwen2.5-0.5B's shape, seq 256, LoRA r8
  .venv/bin/python tools/bench_quantized.py --model tiny --quick # a smoke run
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from edgetrain.profiler.config import ProfileConfig
from edgetrain.profiler.runner import run_isolated

MIB = 2**20


def arms(args: argparse.Namespace) -> list[tuple[str, ProfileConfig]]:
    common = dict(model=args.model, seq=args.seq, rank=8, steps=args.steps, layers=args.layers, fidelity=False)
    chosen = [("mesp, fp32 base", ProfileConfig(method="mesp", **common)),
              ("mesp, 4-bit base", ProfileConfig(method="mesp", quantize_bits=4, **common)),
              ("mebp, fp32 base", ProfileConfig(method="mebp", **common))]
    if args.gguf:
        chosen.append((f"mesp, {args.gguf} as stored", ProfileConfig(
            method="mesp", model=args.gguf, seq=args.seq, rank=8, steps=args.steps, fidelity=False, quantized=True)))
    return chosen


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N blocks")
    parser.add_argument("--gguf", default="smollm2-135m", help="a GGUF model to train with its blocks as stored "
                                                               "('' to skip)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 step, no GGUF arm")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.steps, args.gguf = "tiny", 1, ""
    records = {}
    for name, config in arms(args):
        print(f"... {name}", file=sys.stderr, flush=True)
        records[name] = run_isolated(config)
    base = records["mesp, fp32 base"]
    print(f"{args.model}, seq {args.seq}, LoRA r8, torch-cpu; footprint = held above torch's runtime "
          f"({base['runtime_baseline_bytes'] / MIB:.0f} MiB) + the step's peak; ratios to mesp, fp32 base")
    print(f"{'arm':<36} {'weights MiB':>12} {'footprint MiB':>14} {'ratio':>6} {'step peak MiB':>14} "
          f"{'floor MiB':>10} {'peak/floor':>10} {'s/step':>7} {'ratio':>6}")
    for name, record in records.items():
        floor = record.get("estimate_bytes")
        print(f"{name:<36} {record['weights_bytes'] / MIB:>12.1f} {record['footprint_bytes'] / MIB:>14.1f} "
              f"{record['footprint_bytes'] / base['footprint_bytes']:>5.2f}x {record['peak_bytes_probe'] / MIB:>14.1f} "
              f"{floor / MIB if floor else float('nan'):>10.1f} "
              f"{record['peak_bytes_probe'] / floor if floor else float('nan'):>9.2f}x "
              f"{record['step_seconds']:>7.2f} {record['step_seconds'] / base['step_seconds']:>5.2f}x")
    mebp = records["mebp, fp32 base"]["footprint_bytes"]
    four = records["mesp, 4-bit base"]["footprint_bytes"]
    print(f"mesp 4-bit base / mebp fp32 base: {four / mebp:.2f}x footprint")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(records, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
