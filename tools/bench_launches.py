#!/usr/bin/env python3
"""Kernel launches and step time of LoRA steps, side by side: `bp`, `mesp` and `mesp` with its block programs
compiled (`compile_blocks=True`: CUDA graphs on a GPU), on one model shape and device.

Issue 37's CUDA target: on the Qwen2.5-0.5B shape at seq 256, `mesp` at <=1.0x `bp`'s step time with <=2,000
kernel launches a step (eager mesp: about 17,000 on an H200). Launches are counted by torch.profiler over one
step after the warm-up: the CUDA runtime's kernel launches plus CUDA graph launches (a replayed graph is one
launch). On a CPU there are no launches; the table counts the aten operators the step dispatched instead, which
is what the compiled path fuses away there too. Usage (tools/gpu_check.sh runs the first):

  python3 tools/bench_launches.py --device cuda --model qwen2.5-0.5b --seq 256
  .venv/bin/python tools/bench_launches.py --model tiny --seq 64 --steps 1     # a CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import edgetrain  # noqa: E402
from edgetrain.profiler.batches import build_batch  # noqa: E402
from edgetrain.profiler.config import ProfileConfig  # noqa: E402

ARMS = {"bp": ("bp", {}), "mebp": ("mebp", {}), "mesp": ("mesp", {}),
        "mesp:compiled": ("mesp", {"compile_blocks": True})}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def count_launches(step, device: torch.device) -> int:
    """Kernel launches (CUDA) or aten operators (CPU) during one call of `step`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        _synchronize(device)
    names = [event.name for event in prof.events()]
    if device.type == "cuda":
        return sum(1 for name in names if "LaunchKernel" in name or "GraphLaunch" in name)
    return sum(1 for name in names if name.startswith("aten::"))


def measure(arm: str, args: argparse.Namespace, device: torch.device) -> dict:
    method, options = ARMS[arm]
    torch.manual_seed(0)
    model = edgetrain.load_model(args.model, backend="torch-cuda" if device.type == "cuda" else "torch")
    if args.layers:
        del model.blocks[args.layers:]
    edgetrain.add_lora(model, rank=args.rank)
    learner = edgetrain.Learner(model, method=method, backend="torch-cuda" if device.type == "cuda" else "torch-cpu",
                                optimizer="sgd", lr=1e-5, method_options=options, probe=False)
    batch = build_batch(model, ProfileConfig(model=args.model, seq=args.seq, batch=args.batch))  # as profile's
    started = time.perf_counter()
    for _ in range(args.warmup):
        learner.step(batch)
    _synchronize(device)
    warmup_seconds = time.perf_counter() - started
    seconds = []
    for _ in range(args.steps):
        _synchronize(device)
        start = time.perf_counter()
        learner.step(batch)
        _synchronize(device)
        seconds.append(time.perf_counter() - start)
    return {"arm": arm, "step_seconds": statistics.median(seconds), "spread": (max(seconds) - min(seconds))
            / statistics.median(seconds), "launches": count_launches(lambda: learner.step(batch), device),
            "warmup_seconds": warmup_seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N blocks")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--arms", default="bp,mesp,mesp:compiled")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (the compile, graph recording)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    arms = [arm.strip() for arm in args.arms.split(",")]
    unknown = [arm for arm in arms if arm not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arm(s) {unknown}; known: {', '.join(ARMS)}")
    records = [measure(arm, args, device) for arm in arms]
    unit = "kernel launches" if device.type == "cuda" else "aten ops"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{args.model}, seq {args.seq} x batch {args.batch}, LoRA r{args.rank}, {name}; "
          f"median of {args.steps} steps after {args.warmup} warm-up; ratios to {records[0]['arm']}")
    print(f"{'arm':<16}{'s/step':>10}{'spread':>8}{'ratio':>8}{unit:>18}{'ratio':>8}{'warm-up s':>11}")
    first = records[0]
    for record in records:
        print(f"{record['arm']:<16}{record['step_seconds']:>10.4f}{record['spread']:>8.2f}"
              f"{record['step_seconds'] / first['step_seconds']:>7.2f}x{record['launches']:>18,}"
              f"{record['launches'] / max(first['launches'], 1):>7.2f}x{record['warmup_seconds']:>11.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
