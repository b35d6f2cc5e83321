#!/usr/bin/env python3
"""The MeSP paper's tables, measured side by side in one run, as ratios to `mebp`.

  Table 1: methods x Qwen2.5 0.5B / 1.5B / 3B shapes, seq 256, rank 8
  Table 2: seq 128 / 256 / 512 / 1024 on the 0.5B shape
  Table 4: rank 4 / 8 / 16 / 32 on the 0.5B shape
  Table 5: MeSP storing x@A vs recomputing it (0.5B, seq 256, rank 8)

Every cell is one fresh subprocess of `edgetrain profile`'s worker (same code path as the CLI):
memory is the training peak above the pre-step baseline (weights excluded) by tensor accounting and
by the OS probe; time is the median step after a warm-up. Random-init weights (the shapes are what
matter for memory and time). Usage:

  .venv/bin/python tools/bench_mesp.py                    # all tables, full depth (slow: tens of minutes)
  .venv/bin/python tools/bench_mesp.py --tables 1 --models qwen2.5-0.5b
  .venv/bin/python tools/bench_mesp.py --quick            # 2 blocks of each shape, a smoke run
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgetrain.profiler.config import ProfileConfig  # noqa: E402
from edgetrain.profiler.runner import run_isolated  # noqa: E402

MIB = 2**20
PAPER_TABLE1_MB = {  # Apple Silicon, MLX, 4-bit base, phys_footprint (MeSP paper, Table 1)
    "qwen2.5-0.5b": {"mebp": 360.8, "mezo": 243.0, "mesp": 136.2},
}


# A method spec "mesp:fused" is mesp with the per-block fused optimizer update (the paper's mode).
# "mesp:lean" also drops the learner's rollback copy of the adapters and optimizer state.
SPEC_OPTIONS = {"fused": {"fused_update": True}, "lean": {"fused_update": True, "rollback": False},
                "store": {"store_lora_projection": True}}


def cell(model: str, spec: str, seq: int, rank: int, args, **options) -> dict:
    method, _, variant = spec.partition(":")
    options = {**SPEC_OPTIONS.get(variant, {}), **options}
    if variant and variant not in SPEC_OPTIONS:
        raise SystemExit(f"unknown method variant {spec!r}; known: " + ", ".join(f"mesp:{v}" for v in SPEC_OPTIONS))
    config = ProfileConfig(model=model, method=method, seq=seq, rank=rank, steps=args.steps,
                           dtype=args.dtype, layers=args.layers, fidelity=False, method_options=options)
    print(f"  {model} seq {seq} rank {rank}: {spec} {options or ''} ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    record = run_isolated(config)
    record["label"] = spec
    print(f"    {record['peak_bytes_tensors'] / MIB:.1f} MiB tensors, {record['step_seconds']:.2f} s/step "
          f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    return record


def print_table(title: str, columns: list[str], rows: dict[str, dict[str, dict]], reference: str = "mebp") -> None:
    print(f"\n{title}")
    header = f"{'method':<24}" + "".join(f"{c:>34}" for c in columns)
    print(header)
    print(f"{'':<24}" + "".join(f"{'tensors MiB (x)  probe MiB (x)  time x':>34}" for _ in columns))
    for label, by_column in rows.items():
        line = f"{label:<24}"
        for column in columns:
            record, ref = by_column.get(column), rows[reference].get(column)
            if record is None or ref is None:
                line += f"{'-':>34}"
                continue
            tensors = record["peak_bytes_tensors"]
            probe = record["peak_bytes_probe"] or 0
            text = (f"{tensors / MIB:8.1f} ({tensors / ref['peak_bytes_tensors']:.2f}x) "
                    f"{probe / MIB:7.1f} ({probe / max(ref['peak_bytes_probe'] or 1, 1):.2f}x) "
                    f"{record['step_seconds'] / ref['step_seconds']:5.2f}x")
            line += f"{text:>34}"
        print(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", default="1,2,4,5")
    parser.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-3b", help="Table 1 models")
    parser.add_argument("--methods", default="mebp,mesp,mesp:fused,mesp:lean,mezo,bp",
                        help="mesp:fused = per-block fused optimizer update; mesp:lean = fused without the "
                             "learner's rollback copy")
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N blocks of each shape")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quick", action="store_true", help="2 blocks, 1 step: a smoke run")
    parser.add_argument("--json", default=None, help="write every record here")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.steps = 2, 1
    tables = {t.strip() for t in args.tables.split(",")}
    methods = [m.strip() for m in args.methods.split(",")]
    import torch

    print(f"edgetrain MeSP benchmark: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}, dtype {args.dtype}, "
          f"layers {'all' if args.layers is None else args.layers}, steps {args.steps}; "
          "peaks above the pre-step baseline, weights excluded; ratios to mebp")
    everything = []
    if "1" in tables:
        models = [m.strip() for m in args.models.split(",")]
        rows = {m: {model: cell(model, m, 256, 8, args) for model in models} for m in methods}
        print_table("Table 1: seq 256, rank 8", models, rows)
        everything += [r for by in rows.values() for r in by.values()]
        for model, paper in PAPER_TABLE1_MB.items():
            if model in models:
                ours = {m: rows[m][model]["peak_bytes_probe"] / MIB for m in paper if m in rows}
                print(f"  paper (MLX, 4-bit, phys_footprint) {model}: "
                      + ", ".join(f"{m} {mb} MB ({mb / paper['mebp']:.2f}x)" for m, mb in paper.items())
                      + " | ours (probe): " + ", ".join(f"{m} {mb:.1f} MiB" for m, mb in ours.items()))
    if "2" in tables:
        seqs = [128, 256, 512, 1024]
        rows = {m: {f"seq {s}": cell("qwen2.5-0.5b", m, s, 8, args) for s in seqs} for m in methods}
        print_table("Table 2: qwen2.5-0.5b, rank 8, by sequence length", [f"seq {s}" for s in seqs], rows)
        everything += [r for by in rows.values() for r in by.values()]
        for spec in (m for m in rows if m.startswith("mesp")):
            growth = rows[spec]["seq 1024"]["peak_bytes_tensors"] / rows[spec]["seq 256"]["peak_bytes_tensors"]
            print(f"  {spec} peak at seq 1024 / seq 256: {growth:.2f}x (target <= 2x; paper 3.8x)")
    if "4" in tables:
        ranks = [4, 8, 16, 32]
        rows = {m: {f"rank {r}": cell("qwen2.5-0.5b", m, 256, r, args) for r in ranks} for m in methods}
        print_table("Table 4: qwen2.5-0.5b, seq 256, by LoRA rank", [f"rank {r}" for r in ranks], rows)
        everything += [r for by in rows.values() for r in by.values()]
        for spec in (m for m in rows if m.startswith("mesp")):
            growth = rows[spec]["rank 32"]["peak_bytes_tensors"] / rows[spec]["rank 4"]["peak_bytes_tensors"]
            print(f"  {spec} peak growth rank 4 -> 32: {100 * (growth - 1):+.1f}% (target <= +5%; paper +19%)")
    if "5" in tables:
        rows = {"mebp": {"0.5b": cell("qwen2.5-0.5b", "mebp", 256, 8, args)},
                "mesp (recompute x@A)": {"0.5b": cell("qwen2.5-0.5b", "mesp:lean", 256, 8, args)},
                "mesp (store x@A)": {"0.5b": cell("qwen2.5-0.5b", "mesp:store", 256, 8, args, fused_update=True,
                                                  rollback=False)}}
        print_table("Table 5: store vs recompute the LoRA projection (0.5b, seq 256, rank 8)", ["0.5b"], rows)
        everything += [r for by in rows.values() for r in by.values()]
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
