"""The MeSP paper's Table 1 on MLX: peak memory and step time of mebp, mesp, mezo and bp, as ratios
to MLX mebp, for the Qwen2.5-0.5B / 1.5B / 3B shapes (random weights: memory and time depend on the
shapes only) at seq 256, LoRA rank 8 on all seven projections, 4-bit base (group size 64), batch 1.

Each (model, method) runs in a fresh subprocess through edgetrain.backends.mlx.profile (the real
training path: edgetrain.Learner with backend="mlx", SGD). Memory is the MLX probe: mx.get_peak_memory above the pre-step
baseline (weights and optimizer state excluded, as the paper's per-step figures), max over the
timed steps. mesp runs with fused_update (the paper updates each block's adapters at once).

On Linux the mlx[cpu] wheel's bundled reference BLAS is ~60x slower than OpenBLAS; pass
--openblas PATH (Debian: /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0, found by
itself when installed) to LD_PRELOAD it into the workers. The BLAS that ran is in the header.
Memory ratios do not depend on it. A model's methods run in interleaved rounds (edgetrain.profiler.bench).

    python tools/bench_mlx.py --quick --png mlx.png        # 0.5B shape, 2 blocks, 1 timed step
    python tools/bench_mlx.py --models qwen2.5-0.5b        # the full 24 blocks
    python tools/bench_mlx.py --layers 4                   # all three shapes, first 4 blocks each
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from edgetrain.profiler.bench import (Arm, Column, format_table, measure_interleaved, ratios, summarise, write_json,
                                      write_png)

MARKER = "BENCH_MLX_RESULT "
MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b")
METHODS = ("mebp", "mesp", "mezo", "bp")
# Table 1 of the paper (Apple silicon, phys_footprint, MB): MeBP, MeZO, MeSP at seq 256, rank 8.
PAPER_MB = {"qwen2.5-0.5b": {"mebp": 360.8, "mezo": 243.0, "mesp": 136.2},
            "qwen2.5-1.5b": {"mebp": 516.2, "mezo": 376.0, "mesp": 262.6},
            "qwen2.5-3b": {"mebp": 637.6, "mezo": 479.2, "mesp": 368.4}}
PAPER_SECONDS = {"qwen2.5-0.5b": {"mebp": 0.68, "mezo": 0.51, "mesp": 0.86},
                 "qwen2.5-1.5b": {"mebp": 1.66, "mezo": 1.21, "mesp": 2.17},
                 "qwen2.5-3b": {"mebp": 3.21, "mezo": 2.24, "mesp": 4.09}}
DEBIAN_OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
METHOD_OPTIONS = {"mesp": {"fused_update": True}}
COLUMNS = [Column("peak_bytes_probe", "peak", 1e6, "MB"), Column("step_seconds", "step", 1.0, "s"),
           Column("peak_bytes_os", "OS peak", 1e6, "MB")]


def worker(spec: dict) -> int:
    from edgetrain.backends.mlx.profile import profile_method_mlx
    from edgetrain.profiler.config import ProfileConfig

    config = ProfileConfig(model=spec["model"], method=spec["method"], backend="mlx", seq=spec["seq"],
                           rank=spec["rank"], steps=spec["steps"], layers=spec["layers"],
                           fidelity=spec["fidelity"], method_options=METHOD_OPTIONS.get(spec["method"], {}),
                           quantize_bits=spec["bits"] or None)
    record = profile_method_mlx(config)
    print(MARKER + json.dumps(record), flush=True)
    return 0


def child_environment(openblas: Path | None) -> dict[str, str]:
    from edgetrain.probes.glibc import malloc_threshold_env

    env = dict(os.environ)
    env.update(malloc_threshold_env())
    if openblas is not None:
        env["LD_PRELOAD"] = " ".join(filter(None, [str(openblas), env.get("LD_PRELOAD", "")]))
        # A libopenblas unpacked beside its libgfortran (dpkg -x) finds it here.
        env["LD_LIBRARY_PATH"] = ":".join(filter(None, [str(openblas.parent.parent), str(openblas.parent),
                                                         env.get("LD_LIBRARY_PATH", "")]))
    return env


def run_one(spec: dict, env: dict[str, str]) -> dict:
    command = [sys.executable, __file__, "--worker", json.dumps(spec)]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    raise RuntimeError(f"{spec['model']} / {spec['method']} failed (exit {result.returncode}):\n"
                       + result.stderr[-3000:])


def paper_line(model: str, summaries: dict) -> str:
    paper, seconds = PAPER_MB.get(model, {}), PAPER_SECONDS.get(model, {})
    return f"  paper (Apple silicon, phys_footprint, all blocks) {model}: " + ", ".join(
        f"{m} {mb:.1f} MB ({mb / paper['mebp']:.2f}x), {seconds[m]:.2f} s" for m, mb in paper.items() if m in summaries)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="MeSP Table 1 on MLX (ratios to mebp)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N blocks of each model")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--bits", type=int, default=4, help="base weight bits (0: fp32 base)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    parser.add_argument("--fidelity", action="store_true", help="also compare each gradient with bp's")
    parser.add_argument("--openblas", type=Path, default=None, help="libopenblas.so to LD_PRELOAD (Linux)")
    parser.add_argument("--quick", action="store_true", help="0.5B shape, 2 blocks, 1 timed step")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds of the methods per model")
    parser.add_argument("--json", type=Path, default=None, help="also write the records here")
    parser.add_argument("--png", type=Path, default=None, help="bar chart of the last model's peaks / mebp")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    if args.quick:
        args.models, args.layers, args.steps = ["qwen2.5-0.5b"], args.layers or 2, 1
    openblas = args.openblas
    if openblas is None and sys.platform.startswith("linux") and DEBIAN_OPENBLAS.is_file():
        openblas = DEBIAN_OPENBLAS
    env = child_environment(openblas)
    baseline = "mebp" if "mebp" in args.methods else args.methods[0]
    found = {}
    for model in args.models:
        arms = [Arm(method, lambda method=method: run_one(
            dict(model=model, method=method, seq=args.seq, rank=args.rank, steps=args.steps, layers=args.layers,
                 bits=args.bits, fidelity=args.fidelity), env)) for method in args.methods]
        samples = measure_interleaved(arms, repeats=args.repeats, warmup=0, description=model)
        found[model] = ({m: summarise([{c.metric: s.get(c.metric) for c in COLUMNS} for s in t])
                         for m, t in samples.items()}, samples)
    first = next(iter(found.values()))[1][args.methods[0]][0]
    print(f"MeSP Table 1 on MLX -- device {first['mlx_device']} ({os.cpu_count()} CPU cores), BLAS: {first['blas']}\n"
          f"seq {args.seq}, batch 1, LoRA rank {args.rank} on q,k,v,o,gate,up,down, "
          f"{str(args.bits) + '-bit' if args.bits else 'fp32'} base, fp32 LoRA, blocks: "
          f"{args.layers or 'all'}; peak = MLX probe above the pre-step baseline")
    for model, (summaries, _) in found.items():
        print("\n" + format_table(f"{model}, seq {args.seq}, rank {args.rank}", summaries, baseline, COLUMNS))
        print(paper_line(model, summaries) if model in PAPER_MB else "", flush=True)
    summaries, samples = found[args.models[-1]]
    if args.json:
        write_json(args.json, summaries, baseline, samples, model=args.models[-1],
                   settings={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                   models={m: {"ratios": ratios(s, baseline), "samples": x} for m, (s, x) in found.items()})
    if args.png:
        write_png(args.png, summaries, baseline, COLUMNS[0], title=f"MLX peak, {args.models[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
