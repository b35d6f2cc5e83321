#!/usr/bin/env python3
"""SCPL next to `bp`: training throughput with 1 and 2 workers, and activation memory per worker.

Two workloads (`WORKLOADS`), each with a 2-component split that balances the two workers:
  transformer  the paper's Table 2 setting (SCPL 2 GPUs: 1.32-1.43x bp): a Transformer-encoder text
               classifier (`text-transformer`, dim 128, 8 blocks, 4 heads) on windows of 64 tokens, the
               identity projection head of appendix A.1 for text, no augmentation. Split [embed + 4 blocks |
               4 blocks + head].
  convnet      the Table 3 setting (VGG, paper 0.82-1.24x at 2 GPUs): a VGG-style ConvNet on 3x8x8 inputs,
               eight conv stages of 128 channels (3x3, BatchNorm, ReLU, no pooling), a Linear(8192, 10) head
               and A.1's Linear(8192, 512) - ReLU - Linear(512, 1024) projection head. That head and its
               Adam update cost about as much as four conv stages at batch 32 (the paper's "affiliated
               parameters"), so the split is [3 stages + projection | 5 stages + classifier].
`balance` prints each component's CPU time per step next to bp's: bp / max(component) is the speed-up two
idle cores could give, and thread CPU time barely moves when other jobs share the cores.

Throughput (paper Tables 2-3): input samples per second on synthetic batches of 32, one view (so every
method sees the same samples per step), Adam. Each cell is a fresh process; thread counts are fixed and
printed (torch.set_num_threads and OMP_NUM_THREADS):
  bp        1 process, 1 thread               -- the reference (1.00x)
  scpl      1 process, 1 thread, sequential   -- components one after another
  scpl      2 workers x 1 thread (torchrun, gloo), one component each, pipelined
  bp        1 process, 2 threads              -- the honest comparison: the same two cores, one process
  scpl      2 workers x 1 thread, 2 micro-batches (A.5's SCPL + GPipe hybrid)
The 1-thread single-process cells run as two identical copies at once and report the per-copy rate,
so both sides of the comparison hold two runnable threads (on an idle 2-core machine that is the
same as running alone; when other jobs share the cores it gives both sides the same share); their
"alone" rate is listed too. Cells run in interleaved rounds (edgetrain.profiler.bench, --repeats rounds)
and are reported as medians with their spread and ratios to bp 1x1, with the machine's load average.

Memory (convnet, 4 components, split [2, 2, 2, 2]): bytes autograd saves for backward in one step (each
storage once, weights excluded) and the tensor-accounting peak above the step's baseline
(edgetrain.probes.tensors), for bp, for sequential scpl (one component's graph at a time) and for each
of 4 pipeline workers (measured inside the workers).

  .venv/bin/python tools/bench_scpl.py              # everything, both workloads (about 15 min on 2 idle cores)
  .venv/bin/python tools/bench_scpl.py --quick      # fewer steps and repeats
  .venv/bin/python tools/bench_scpl.py --only throughput --workloads transformer   # or balance, memory
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from itertools import cycle
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import edgetrain  # noqa: E402
from edgetrain.data.batch import Batch  # noqa: E402
from edgetrain.models.convnet import ConvNetConfig, build_convnet  # noqa: E402
from edgetrain.models.text_transformer import TextTransformerConfig, build_text_transformer  # noqa: E402
from edgetrain.profiler.bench import (Arm, Column, format_table, measure_interleaved, ratios,  # noqa: E402
                                      summarise, write_json, write_png)

BATCH = 32
SPLIT_4 = [2, 2, 2, 2]
MIB = 2**20
COMPARISONS: list[tuple[dict, str, dict, str, Column]] = []  # (summaries, baseline, samples, title, headline column)


def compare(title: str, arms: list[Arm], baseline: str, columns: list[Column], repeats: int, warmup: int,
            rows=lambda samples: samples) -> dict:
    """The arms in interleaved rounds; prints the table of rows(samples) and keeps it for --json / --png."""
    samples = measure_interleaved(arms, repeats=repeats, warmup=warmup, description=title.split(",")[0])
    summaries = {row: summarise([{c.metric: s.get(c.metric) for c in columns} for s in taken])
                 for row, taken in rows(samples).items()}
    print("\n" + format_table(title, summaries, baseline, columns), flush=True)
    COMPARISONS.append((summaries, baseline, samples, title, columns[0]))
    return samples


def bench_model() -> torch.nn.Module:
    return build_convnet(ConvNetConfig(input_shape=(3, 8, 8), channels=(128,) * 8, kernel_size=3, padding=1, pool=1,
                                       batch_norm=True, hidden_sizes=(), num_classes=10, activation="relu", seed=0))


def transformer_model() -> torch.nn.Module:
    # max_len 64: random_stream's text windows are 64 tokens.
    return build_text_transformer(TextTransformerConfig(dim=128, depth=8, num_heads=4, max_len=64, num_classes=4,
                                                        seed=0))


@dataclass(frozen=True)
class Workload:
    builder: str          # "module:function", importable by every pipeline worker
    split: list[int]      # units per component of the balanced 2-component split
    description: str

    def build(self) -> torch.nn.Module:
        from edgetrain.recipes.scpl_pipeline import build_model

        return build_model(self.builder)


WORKLOADS = {
    "transformer": Workload("tools.bench_scpl:transformer_model", [5, 4],
                            "Transformer text classifier (dim 128, 8 blocks, 64 tokens, identity projection; "
                            "paper Table 2's setting)"),
    "convnet": Workload("tools.bench_scpl:bench_model", [3, 5],
                        "VGG-style ConvNet (8 conv stages of 128 channels on 8x8 maps, A.1 MLP projection; "
                        "paper Table 3's setting)"),
}


def batches(model: torch.nn.Module, count: int) -> list[Batch]:
    from edgetrain.recipes.scpl_pipeline import random_stream

    stream = random_stream(model, BATCH, seed=0)
    return [next(stream) for _ in range(count)]


# -- one cell in this process -------------------------------------------------------------------

def run_cell(workload: str, method: str, threads: int, warmup: int, steps: int) -> dict:
    torch.set_num_threads(threads)
    model = WORKLOADS[workload].build()
    options = {"views": 1, "split": WORKLOADS[workload].split} if method == "scpl" else {}
    learner = edgetrain.Learner(model, method=method, optimizer="adam", lr=1e-3, probe=False, method_options=options)
    data = batches(model, warmup + steps)
    for batch in data[:warmup]:
        learner.step(batch)
    start = time.perf_counter()
    for batch in data[warmup:]:
        learner.step(batch)
    seconds = time.perf_counter() - start
    return {"samples_per_second": steps * BATCH / seconds, "threads": torch.get_num_threads()}


def subprocess_cell(workload: str, method: str, threads: int, warmup: int, steps: int, copies: int = 1) -> dict:
    """Run the cell in `copies` identical processes at once; their mean throughput."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cell = {"workload": workload, "method": method, "threads": threads, "warmup": warmup, "steps": steps}
    command = [sys.executable, __file__, "--cell", json.dumps(cell)]
    running = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
               for _ in range(copies)]
    results = []
    for process in running:
        stdout, stderr = process.communicate(timeout=900)
        if process.returncode != 0:
            raise RuntimeError(f"cell {method}/{threads} failed:\n{stderr[-3000:]}")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return {"samples_per_second": statistics.mean(r["samples_per_second"] for r in results),
            "threads": results[0]["threads"]}


def pipeline_cell(workload: str, workers: int, warmup: int, steps: int, split: list[int], micro_batches: int = 1,
                  memory: bool = False) -> dict:
    from edgetrain.recipes.scpl_pipeline import PipelineConfig, launch

    config = PipelineConfig(model=WORKLOADS[workload].builder, method="scpl", method_options={"views": 1, "split": split},
                            data="random", batch_size=BATCH, steps=steps, warmup_steps=warmup, optimizer="adam",
                            lr=1e-3, micro_batches=micro_batches, threads=1, device="cpu", memory=memory)
    return launch(config, workers, timeout=900)


# -- throughput ---------------------------------------------------------------------------------

def throughput(workload: str, repeats: int, warmup: int, steps: int) -> None:
    """Single-thread single-process cells run as two identical copies at once (per-copy throughput), so
    they hold as many runnable threads as the two pipeline workers: on an idle 2-core machine each copy
    has a core of its own, exactly like one process alone, and when other jobs share the cores both
    sides get the same share of them. The copies share memory bandwidth, as the workers do. Arms "alone": the same."""
    split = WORKLOADS[workload].split
    cells = {
        "bp, 1 process x 1 thread": lambda: subprocess_cell(workload, "bp", 1, warmup, steps, copies=2),
        "scpl sequential, 1 process x 1 thread": lambda: subprocess_cell(workload, "scpl", 1, warmup, steps, copies=2),
        "scpl pipelined, 2 workers x 1 thread": lambda: pipeline_cell(workload, 2, warmup, steps, split),
        "scpl pipelined, 2 workers x 1 thread, 2 micro-batches": lambda: pipeline_cell(workload, 2, warmup, steps,
                                                                                      split, 2),
        "bp, 1 process x 2 threads": lambda: subprocess_cell(workload, "bp", 2, warmup, steps),
        "bp, 1 process x 1 thread, alone": lambda: subprocess_cell(workload, "bp", 1, warmup, steps),
        "scpl sequential, 1 process x 1 thread, alone": lambda: subprocess_cell(workload, "scpl", 1, warmup, steps),
    }
    samples = compare(f"Throughput, {workload}: {WORKLOADS[workload].description}, batch {BATCH}, Adam, one view; "
                      f"{steps} timed steps after {warmup} warm-up in each cell; 1-thread single-process cells run "
                      "as two copies at once unless alone (see throughput())",
                      [Arm(name, lambda c=cell: {"load": os.getloadavg()[0], **c()}) for name, cell in cells.items()],
                      "bp, 1 process x 1 thread", [Column("samples_per_second", "throughput", 1.0, "samples/s")],
                      repeats, warmup=0)
    loads = [sample["load"] for taken in samples.values() for sample in taken]
    pipe = samples["scpl pipelined, 2 workers x 1 thread"][-1]
    workers = "; ".join(f"rank {w['rank']} busy {w['busy_seconds']:.2f} s, waiting {w['wait_seconds']:.2f} s"
                        for w in pipe["workers"])
    print(f"load average during the run {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores; split "
          f"{pipe['split']}; last run's workers: {workers}")


# -- compute balance (CPU time, robust to other jobs on the cores) ----------------------------------

def balance(workload: str, steps: int = 6, warmup: int = 2) -> None:
    """One thread's CPU time per step for each component of the 2-component split (forward, local loss,
    backward, its Adam step) and for bp, interleaved: max(component) bounds the pipelined step, so bp / max is
    the speedup two idle cores could give. Thread CPU time barely moves when other jobs share the cores."""
    torch.set_num_threads(1)
    model = WORKLOADS[workload].build()
    learner = edgetrain.Learner(model, method="scpl", optimizer="adam", lr=1e-3, probe=False,
                                method_options={"views": 1, "split": WORKLOADS[workload].split})
    components = learner.method.components
    optimizers = [torch.optim.Adam(list(c.params.values()), lr=1e-3) for c in components]
    bp = edgetrain.Learner(WORKLOADS[workload].build(), method="bp", optimizer="adam", lr=1e-3, probe=False)
    scpl_data, bp_data = cycle(batches(model, warmup + steps)), cycle(batches(model, warmup + steps))

    def scpl_step() -> dict:
        batch, cpu = next(scpl_data), {}
        h = batch.inputs
        for k, component in enumerate(components):
            start = time.thread_time()
            out = component.encode(h)
            component.local_loss(out, batch.targets).backward()
            optimizers[k].step()
            optimizers[k].zero_grad(set_to_none=True)
            cpu[f"component {k}"] = (time.thread_time() - start) * 1000
            h = out.detach()
        return {"cpu_ms": sum(cpu.values()), **cpu}

    def bp_step() -> dict:
        start = time.thread_time()
        bp.step(next(bp_data))
        return {"cpu_ms": (time.thread_time() - start) * 1000}
    columns = [Column(m, m.replace("cpu_ms", "step"), 1.0, "CPU ms")
               for m in ["cpu_ms", *(f"component {c.index}" for c in components)]]
    compare(f"Compute balance, {workload}: one thread's CPU time per step of {BATCH}; " + ", ".join(
        f"component {c.index} = {c.name}" for c in components), [Arm("bp", bp_step), Arm("scpl sequential", scpl_step)],
        "bp", columns, repeats=steps, warmup=warmup)
    summaries = COMPARISONS[-1][0]
    bp_ms, scpl_ms = summaries["bp"]["cpu_ms"].median, summaries["scpl sequential"]["cpu_ms"].median
    slowest = max(summaries["scpl sequential"][c.metric].median for c in columns[1:])
    print(f"Ideal 2-worker pipeline: bp / max(component) = {bp_ms / slowest:.2f}x bp, {scpl_ms / slowest:.2f}x scpl "
          "sequential.")


# -- memory -------------------------------------------------------------------------------------

def in_process_memory(method: str) -> dict:
    from edgetrain.recipes.scpl_pipeline import SavedActivations
    from edgetrain.probes.tensors import TensorAccountant

    torch.set_num_threads(1)
    model = bench_model()
    options = {"views": 1, "split": SPLIT_4} if method == "scpl" else {}
    learner = edgetrain.Learner(model, method=method, optimizer="adam", lr=1e-3, probe=False, method_options=options)
    warm, batch = batches(model, 2)
    learner.step(warm)  # optimizer state exists before the measured step
    weights = list(learner.params.values())
    saved_per_part = []
    if method == "bp":
        with SavedActivations(weights) as saved:
            loss = torch.nn.functional.cross_entropy(model(batch.inputs), batch.targets)
        saved_per_part.append(saved.bytes)
        del loss
    else:
        h = batch.inputs
        for component in learner.method.components:
            with SavedActivations(weights) as saved:
                out = component.encode(h)
                component.local_loss(out, batch.targets)  # counted as autograd saves, freed at once
            saved_per_part.append(saved.bytes)
            h = out.detach()
            del out
    learner.optimizer.zero_grad(set_to_none=True)
    accountant = TensorAccountant(model)
    accountant.register(learner.optimizer)
    with accountant:
        learner.step(batch)
    return {"saved": saved_per_part, "peak": accountant.report().peak_above_baseline_bytes,
            "parameters": sum(p.numel() for p in learner.params.values())}


def memory() -> None:
    """bp, sequential scpl and a 4-worker pipeline (a row per worker), one round: tensor accounting."""
    def worker_rows(samples: dict) -> dict:
        rows = {name: [{**s, "saved": max(s["saved"])} for s in samples[arm]] for name, arm in (
            ("bp, one process", "bp"), ("scpl sequential, one process (largest component)", "scpl sequential"))}
        for worker in samples["scpl pipeline"][0]["workers"]:
            rows[f"scpl pipeline worker {worker['rank']} ({worker['component']})"] = [
                {"saved": worker["memory"]["saved_activation_bytes"], "parameters": worker["parameters"],
                 "peak": worker["memory"]["tensor_peak_above_baseline_bytes"]}]
        return rows
    columns = [Column("saved", "saved activations", MIB, "MiB"), Column("peak", "peak above baseline", MIB, "MiB"),
               Column("parameters", "trainable parameters", 1e6, "M")]
    compare(f"Memory: convnet workload, batch {BATCH}, 4 components (split {SPLIT_4}); saved = bytes autograd keeps "
            "for backward (weights excluded), peak = tensor accounting above the step's baseline (activations, "
            "gradients, temporaries; weights and optimizer state are the baseline)",
            [Arm("bp", lambda: in_process_memory("bp")), Arm("scpl sequential", lambda: in_process_memory("scpl")),
             Arm("scpl pipeline", lambda: pipeline_cell("convnet", 4, warmup=1, steps=1, split=SPLIT_4, memory=True))],
            "bp, one process", columns, 1, 0, rows=worker_rows)
    print("A worker's peak above baseline includes its parameters' gradients and the optimizer's temporaries: the "
          "projection head's Linear(dim, 512) is the largest tensor there (SCPL's affiliated parameters).")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("balance", "throughput", "memory"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--workloads", type=lambda text: text.split(","), default=list(WORKLOADS),
                        help=f"throughput and balance workloads, comma-separated ({', '.join(WORKLOADS)})")
    parser.add_argument("--json", default=None, help="write every comparison here")
    parser.add_argument("--png", default=None, help="chart of the last throughput (else balance, memory) table")
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        cell = json.loads(args.cell)
        print(json.dumps(run_cell(cell["workload"], cell["method"], cell["threads"], cell["warmup"], cell["steps"])))
        return 0
    repeats = args.repeats or (1 if args.quick else 3)
    steps = args.steps or (8 if args.quick else 30)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores; every worker: torch.set_num_threads and "
          "OMP_NUM_THREADS as stated\n")
    unknown = sorted(set(args.workloads) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workload(s) {', '.join(unknown)}; known: {', '.join(WORKLOADS)}")
    if args.only in (None, "balance"):
        for workload in args.workloads:
            balance(workload)
    if args.only in (None, "throughput"):
        for workload in args.workloads:
            throughput(workload, repeats, warmup=3, steps=steps)
    headline = COMPARISONS[-1] if COMPARISONS else None
    if args.only in (None, "memory"):
        memory()
    summaries, baseline, samples, title, column = headline or COMPARISONS[-1]
    if args.json:
        write_json(args.json, summaries, baseline, samples, headline=title, settings=vars(args),
                   comparisons={t: {"baseline": b, "ratios": ratios(x, b), "samples": y}
                                for x, b, y, t, _ in COMPARISONS})
    if args.png:
        write_png(args.png, summaries, baseline, column, title=title.split(":")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
