#!/usr/bin/env python3
"""The MeSP paper's tables, measured side by side in one run, as ratios to `mebp`.

  Table 1: methods x Qwen2.5 0.5B / 1.5B / 3B shapes, seq 256, rank 8
  Table 2: seq 128 / 256 / 512 / 1024 on the 0.5B shape
  Table 4: rank 4 / 8 / 16 / 32 on the 0.5B shape
  Table 5: MeSP storing x@A vs recomputing it (0.5B, seq 256, rank 8)

Every measurement is one fresh subprocess of `edgetrain profile`'s worker (same code path as the CLI):
memory is the training peak above the pre-step baseline (weights excluded) by tensor accounting and
by the OS probe; time is the median step after the worker's warm-up. The methods of one table column
are measured in interleaved rounds (edgetrain.profiler.bench; --repeats rounds) and reported as medians
with their spread and ratios to mebp. Random-init weights (the shapes are what matter). Usage:

  .venv/bin/python tools/bench_mesp.py                    # all tables, full depth (slow: tens of minutes)
  .venv/bin/python tools/bench_mesp.py --tables 1 --models qwen2.5-0.5b
  .venv/bin/python tools/bench_mesp.py --quick            # 2 blocks of each shape, a smoke run
"""
from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgetrain.profiler.bench import Arm, Column, Summary, format_table, measure_interleaved, summarise  # noqa: E402
from edgetrain.profiler.config import ProfileConfig  # noqa: E402
from edgetrain.profiler.runner import run_isolated  # noqa: E402

MIB = 2**20
PAPER_TABLE1_MB = {  # Apple Silicon, MLX, 4-bit base, phys_footprint (MeSP paper, Table 1)
    "qwen2.5-0.5b": {"mebp": 360.8, "mezo": 243.0, "mesp": 136.2},
}


# A method spec "mesp:fused" is mesp with the per-block fused optimizer update (the paper's mode).
# "mesp:lean" also drops the learner's rollback copy of the adapters and optimizer state.
# "mesp:fresh" allocates every temporary anew (reuse_buffers=False), as mesp did before step_buffers.py.
SPEC_OPTIONS = {"fused": {"fused_update": True}, "lean": {"fused_update": True, "rollback": False},
                "store": {"store_lora_projection": True}, "fresh": {"reuse_buffers": False}}


COLUMNS = [Column("peak_bytes_tensors", "tensors", MIB, "MiB"), Column("peak_bytes_probe", "probe", MIB, "MiB"),
           Column("step_seconds", "time", 1.0, "s/step"), Column("floor_ratio", "over floor", 1.0, "x"),
           Column("minor_faults_per_step", "page faults", 1000.0, "k/step")]


def measure_column(title: str, model: str, specs: list[str], seq: int, rank: int, args,
                   **options) -> dict[str, dict[str, Summary]]:
    """The methods `specs` on one shape, interleaved over --repeats rounds; prints the column's table."""
    arms = []
    for spec in specs:
        method, _, variant = spec.partition(":")
        if variant and variant not in SPEC_OPTIONS:
            raise SystemExit(f"unknown method variant {spec!r}; known: " + ", ".join(f"mesp:{v}" for v in SPEC_OPTIONS))
        config = ProfileConfig(model=model, method=method, seq=seq, rank=rank, steps=args.steps, dtype=args.dtype,
                               layers=args.layers, fidelity=False,
                               method_options={**SPEC_OPTIONS.get(variant, {}), **options.get(spec, {})})
        arms.append(Arm(spec, lambda config=config: run_isolated(config)))
    samples = measure_interleaved(arms, repeats=args.repeats, warmup=0, description=title)
    summaries = {spec: summarise([{c.metric: s.get(c.metric) for c in COLUMNS} for s in taken])
                 for spec, taken in samples.items()}
    print("\n" + format_table(title, summaries, specs[0] if "mebp" not in specs else "mebp", COLUMNS))
    RECORDS.append({"table": title, "model": model, "seq": seq, "rank": rank, "samples": samples})
    return summaries


RECORDS: list[dict] = []


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
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds per table column")
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
    if "1" in tables:
        for model in (m.strip() for m in args.models.split(",")):
            column = measure_column(f"Table 1: {model}, seq 256, rank 8", model, methods, 256, 8, args)
            paper = PAPER_TABLE1_MB.get(model)
            if paper:
                ours = {m: column[m]["peak_bytes_probe"].median / MIB for m in paper if m in column}
                print(f"  paper (MLX, 4-bit, phys_footprint) {model}: "
                      + ", ".join(f"{m} {mb} MB ({mb / paper['mebp']:.2f}x)" for m, mb in paper.items())
                      + " | ours (probe): " + ", ".join(f"{m} {mb:.1f} MiB" for m, mb in ours.items()))
    if "2" in tables:
        by_seq = {seq: measure_column(f"Table 2: qwen2.5-0.5b, rank 8, seq {seq}", "qwen2.5-0.5b", methods, seq, 8,
                                      args) for seq in (128, 256, 512, 1024)}
        for spec in (m for m in methods if m.startswith("mesp")):
            growth = by_seq[1024][spec]["peak_bytes_tensors"].median / by_seq[256][spec]["peak_bytes_tensors"].median
            print(f"  {spec} peak at seq 1024 / seq 256: {growth:.2f}x (target <= 2x; paper 3.8x)")
    if "4" in tables:
        by_rank = {rank: measure_column(f"Table 4: qwen2.5-0.5b, seq 256, rank {rank}", "qwen2.5-0.5b", methods, 256,
                                        rank, args) for rank in (4, 8, 16, 32)}
        for spec in (m for m in methods if m.startswith("mesp")):
            growth = by_rank[32][spec]["peak_bytes_tensors"].median / by_rank[4][spec]["peak_bytes_tensors"].median
            print(f"  {spec} peak growth rank 4 -> 32: {100 * (growth - 1):+.1f}% (target <= +5%; paper +19%)")
    if "5" in tables:
        # mesp:lean recomputes x@A; mesp:store keeps it (both fused, without the rollback copy).
        measure_column("Table 5: store vs recompute the LoRA projection (0.5b, seq 256, rank 8)", "qwen2.5-0.5b",
                       ["mebp", "mesp:lean", "mesp:store"], 256, 8, args,
                       **{"mesp:store": {"fused_update": True, "rollback": False}})
    if args.json:
        from edgetrain.training.checkpoint import atomic_write_json

        atomic_write_json(RECORDS, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
