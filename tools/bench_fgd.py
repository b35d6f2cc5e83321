#!/usr/bin/env python3
"""Forward-gradient methods (`fgd`, `asyncfgd`) next to `bp`, measured side by side in one run.

  Memory (AsyncFGD Fig. 3a and App. I.3): one training step's tensor bytes by tensor accounting
    (edgetrain.probes.tensors) for FC stacks of growing depth and for the ConvS/ConvL convnets:
    bp, fgd, and asyncfgd with one module per hidden layer, with tangent checkpointing on and off
    (Async vs Async-dagger). "total" is weights + everything alive at the step's peak (activations,
    JVPs, tangents, grads, and for asyncfgd the in-flight pipeline state); "above" excludes weights.
  Throughput (§6.5, App. I.2): steps/s on a stream of batch 4 for ResNet-18 (CIFAR shape):
    fgd with one worker and one intra-op thread, fgd with one worker and all cores, asyncfgd K=2
    (two worker threads, one intra-op thread each, pinned), a synchronous K=2 pipeline (the batch cut
    into micro-batches of 1, the paper's setting for it), and asyncfgd run sequentially.
  CUDA streams: asyncfgd K=2 on one GPU with a stream per module vs fgd on that GPU (skipped,
    with a message, without CUDA).

Memory cells run the pipeline's reference scheduler in one thread (a TorchDispatchMode only sees the
thread it is entered in); parallel workers add nothing but their concurrent working sets, at most one
module's activations and JVPs each. Every comparison runs through edgetrain.profiler.bench (one step of
each arm per round, alternating order, after warm-up rounds; median, spread, ratios to the baseline). Usage:

  .venv/bin/python tools/bench_fgd.py                 # everything (a few minutes on 2 cores)
  .venv/bin/python tools/bench_fgd.py --quick         # smaller sweep, fewer timed rounds
  .venv/bin/python tools/bench_fgd.py --only memory   # or throughput, cuda; --json, --png for the records
"""
from __future__ import annotations

import argparse
import os
import platform
import queue
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import edgetrain  # noqa: E402
import edgetrain.methods.asyncfgd  # noqa: E402,F401  (registers asyncfgd)
import edgetrain.methods.fgd  # noqa: E402,F401  (registers fgd)
from edgetrain.data.batch import Batch  # noqa: E402
from edgetrain.methods.asyncfgd import AsyncFGD  # noqa: E402
from edgetrain.methods.fgd import plain_sgd_learning_rates  # noqa: E402
from edgetrain.models import load_model  # noqa: E402
from edgetrain.models.mlp import MLPConfig, build_mlp  # noqa: E402
from edgetrain.models.zoo import example_input  # noqa: E402
from edgetrain.profiler.bench import (Arm, Column, Summary, format_table, measure_interleaved,  # noqa: E402
                                      ratios, summarise, write_json, write_png)
from edgetrain.probes.tensors import TensorAccountant  # noqa: E402

MIB = 2**20
MEMORY_COLUMNS = [Column("total", "total", MIB, "MiB"), Column("above", "above weights", MIB, "MiB")]
TIME_COLUMNS = [Column("seconds", "step", 1e-3, "ms"), Column("steps_per_s", "throughput", 1.0, "steps/s")]
COMPARISONS: dict[str, tuple[dict[str, dict[str, Summary]], str, dict]] = {}


def compare(title: str, arms: list[Arm], baseline: str, columns: list[Column], repeats: int, warmup: int) -> dict:
    """The arms in interleaved rounds; prints their table and keeps it for --json / --png."""
    samples = measure_interleaved(arms, repeats=repeats, warmup=warmup, description=title.split(":")[0])
    summaries = {a: summarise([{c.metric: s.get(c.metric) for c in columns} for s in t]) for a, t in samples.items()}
    print("\n" + format_table(title, summaries, baseline, columns), flush=True)
    COMPARISONS[title] = (summaries, baseline, samples)
    return summaries


def write_outputs(args: argparse.Namespace, headline: tuple[str, Column], **context) -> None:
    """--json: the headline comparison through write_json, every comparison with it; --png: its chart."""
    summaries, baseline, samples = COMPARISONS[headline[0]]
    if args.json:
        write_json(args.json, summaries, baseline, samples, headline=headline[0], **context,
                   comparisons={t: {"baseline": b, "ratios": ratios(s, b), "samples": x}
                                for t, (s, b, x) in COMPARISONS.items()})
    if args.png:
        write_png(args.png, summaries, baseline, headline[1], title=headline[0].split(":")[0])


# -- memory ----------------------------------------------------------------------------------------

def fc_stack(depth: int, width: int = 1024) -> nn.Module:
    """FCS-style stack (MNIST input, Tanh, no norm) with `depth` hidden layers of `width`."""
    return build_mlp(MLPConfig(input_shape=(1, 28, 28), hidden_sizes=(width,) * depth, num_classes=10,
                               activation="tanh"))


def random_batch(model: nn.Module, batch_size: int, seed: int = 0) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    return Batch(example_input(model, batch_size, 0, generator=generator),
                 torch.randint(0, 10, (batch_size,), generator=generator))


def step_memory(build: Callable[[], nn.Module], method: str, options: dict, batch_size: int) -> dict:
    """Tensor bytes of one steady-state step (the pipeline filled first)."""
    model = build()
    batch = random_batch(model, batch_size)
    learner = edgetrain.Learner(model, method=method, lr=1e-5, probe=False, method_options=options)
    for _ in range(options.get("num_modules", 1)):
        learner.step(batch)
    accountant = TensorAccountant(model)
    if method == "asyncfgd":  # the pipeline's state between steps is part of its memory
        accountant.register(*learner.method.in_flight_tensors())
    with accountant:
        learner.step(batch)
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    peak = accountant.report().peak_bytes
    getattr(learner.method, "close", lambda: None)()
    return {"weights": weights, "total": peak, "above": peak - weights}


def memory_variants(k: int) -> dict[str, tuple[str, dict]]:
    asyncfgd = {"num_modules": k, "runtime": "reference"}
    return {"bp": ("bp", {}), "fgd": ("fgd", {}), "fgd (no tangent ckpt)": ("fgd", {"tangent_checkpoint": False}),
            f"asyncfgd K={k}": ("asyncfgd", asyncfgd),
            f"asyncfgd K={k} (no tangent ckpt)": ("asyncfgd", {**asyncfgd, "tangent_checkpoint": False})}


def memory_table(title: str, columns: dict[str, tuple[Callable[[], nn.Module], int]], batch_size: int) -> dict:
    """One comparison per column (depth, convnet), the variants its arms; deterministic, so one round."""
    found = {}
    for column, (build, k) in columns.items():
        arms = [Arm(label.replace(f"K={k}", "K=L"), lambda m=method, o=options: step_memory(build, m, o, batch_size))
                for label, (method, options) in memory_variants(k).items()]
        found[column] = compare(f"{title}: {column}, batch {batch_size}", arms, "bp", MEMORY_COLUMNS, 1, 0)
    print("K=L: one module per hidden layer (embed joins the first, the head the last).")
    return found


# -- throughput ------------------------------------------------------------------------------------

def pin_current_thread(core: int | None) -> None:
    if core is not None and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, {core})
        except OSError:
            pass


class SyncPipeline:
    """Synchronous pipelined FGD (GPipe-style, no staleness): the batch is cut into micro-batches
    that flow through K worker threads; once all have left, the mean directional derivative updates
    every module with the step's one tangent. Same stages and tangents as asyncfgd."""

    def __init__(self, model: nn.Module, num_modules: int, micro_batch: int, seed: int = 0) -> None:
        self.pipeline = AsyncFGD(model, num_modules=num_modules, runtime="reference", seed=seed)
        self.stages = self.pipeline.stages
        self.micro_batch = micro_batch
        self.steps_taken = 0
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.inboxes = [queue.SimpleQueue() for _ in self.stages]
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._serve, args=(k, cores[k % len(cores)] if cores else None),
                                         daemon=True) for k in range(len(self.stages))]
        for thread in self.threads:
            thread.start()

    def _serve(self, k: int, core: int | None) -> None:
        torch.set_num_threads(1)
        pin_current_thread(core)
        stage = self.stages[k]
        while True:
            item = self.inboxes[k].get()
            if item is None:
                return
            sample, h, jvps, targets = item
            h, jvps = stage.forward(sample, h, jvps)
            if stage.is_last:
                self.outbox.put(stage.loss_derivatives(h, jvps, targets))
            else:
                self.inboxes[k + 1].put((sample, h, jvps, targets))

    def step(self, batch: Batch, optimizer: torch.optim.Optimizer) -> float:
        sample = self.steps_taken
        pieces = list(zip(batch.inputs.split(self.micro_batch), batch.targets.split(self.micro_batch)))
        for inputs, targets in pieces:
            self.inboxes[0].put((sample, inputs, [None], targets))
        results = [self.outbox.get() for _ in pieces]
        derivative = statistics.fmean(ds[0] for _, ds in results)
        rates = plain_sgd_learning_rates(optimizer)
        for stage in self.stages:
            stage.update_in_place(sample, [derivative], rates)
        self.steps_taken += 1
        return statistics.fmean(float(loss) for loss, _ in results)

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        self.pipeline.close()


def time_arms(title: str, specs: dict[str, tuple[int, Callable[[nn.Module], object]]], model_name: str,
              batch_size: int, warmup: int, repeats: int, device: str = "cpu", sync: Callable[[], None] = lambda: None):
    """One arm per spec (label -> intra-op threads, trainer factory; the first is the baseline): a fresh model
    and trainer each, built before the rounds; a run is one timed step with the spec's thread count."""
    default_threads, arms, closers = torch.get_num_threads(), [], []
    for label, (threads, make) in specs.items():
        torch.set_num_threads(threads)
        model = load_model(model_name, device=device)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        trainer, batch = make(model), random_batch(model, batch_size).to(device)
        closers.append(getattr(trainer, "close", lambda: None))

        def run(step=lambda trainer=trainer, optimizer=optimizer, batch=batch: trainer.step(batch, optimizer),
                threads=threads) -> dict:
            torch.set_num_threads(threads)
            start = time.perf_counter()
            step()
            sync()
            seconds = time.perf_counter() - start
            return {"seconds": seconds, "steps_per_s": 1 / seconds}
        arms.append(Arm(label, run))
    try:
        return compare(title, arms, next(iter(specs)), TIME_COLUMNS, repeats, warmup)
    finally:
        for close in closers:
            close()
        torch.set_num_threads(default_threads)


def throughput_table(model_name: str, batch_size: int, warmup: int, repeats: int, cores: int) -> dict:
    fgd = lambda m: edgetrain.methods.fgd.ForwardGradient(m)  # noqa: E731
    both = f"fgd, 1 worker x {cores} threads"
    specs = {"fgd, 1 worker x 1 thread": (1, fgd), both: (cores, fgd),
             "asyncfgd K=2, 2 workers x 1 thread": (1, lambda m: AsyncFGD(m, num_modules=2, runtime="threads")),
             "sync pipeline K=2 (micro-batch 1)": (1, lambda m: SyncPipeline(m, 2, micro_batch=1)),
             "asyncfgd K=2, sequential (1 thread)": (1, lambda m: AsyncFGD(m, num_modules=2, runtime="reference"))}
    summaries = time_arms(f"Throughput: {model_name}, stream batch {batch_size}, {cores} cores (a shared machine: "
                          "figures are noisy)", specs, model_name, batch_size, warmup, repeats)
    print(f"steps/s vs {both}: " + ", ".join(f"{a} {r['steps_per_s']:.2f}x" for a, r in ratios(summaries, both).items()
                                             if a != both))
    return summaries


def cuda_table(model_name: str, batch_size: int, warmup: int, repeats: int) -> dict | None:
    if not torch.cuda.is_available():
        print("\nCUDA streams: skipped -- no CUDA device here (run this on a Jetson / GPU machine: "
              "asyncfgd K=2 and 3 with runtime='cuda-streams' vs fgd, K=1, on the same GPU)")
        return None
    return time_arms(f"CUDA streams: {model_name} on {torch.cuda.get_device_name()}, batch {batch_size}",
                     cuda_specs(torch.get_num_threads()), model_name, batch_size, warmup, repeats, "cuda",
                     torch.cuda.synchronize)


def cuda_specs(threads: int, modules: tuple[int, ...] = (2, 3)) -> dict[str, tuple[int, Callable]]:
    """The CUDA arms: K = 1 (fgd on one stream, the baseline), asyncfgd on K streams for each K in `modules`
    (the paper reports K = 1..4 on an AGX Orin, Fig. 4 and 8), and K = 2 run sequentially (the same schedule
    without streams: what the streams add)."""
    specs = {"fgd, K=1 (one stream)": (threads, lambda m: edgetrain.methods.fgd.ForwardGradient(m))}
    for k in modules:
        specs[f"asyncfgd K={k}, {k} CUDA streams"] = (threads, lambda m, k=k: AsyncFGD(m, num_modules=k,
                                                                                       runtime="cuda-streams"))
    specs["asyncfgd K=2, sequential"] = (threads, lambda m: AsyncFGD(m, num_modules=2, runtime="reference"))
    return specs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sweep, fewer timed rounds")
    parser.add_argument("--only", choices=("memory", "throughput", "cuda"), default=None)
    parser.add_argument("--model", default="resnet18-cifar", help="throughput model (default resnet18-cifar)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed rounds, one step of each arm per round (default 12; --quick 5; cuda 30)")
    parser.add_argument("--cuda-batch-sizes", default="4", type=lambda text: [int(v) for v in text.split(",")],
                        help="comma-separated stream batch sizes of the CUDA tables (default 4, the paper's)")
    parser.add_argument("--json", default=None, help="write every comparison here")
    parser.add_argument("--png", default=None, help="bar chart of the headline comparison (throughput, else the "
                                                    "deepest FC stack's memory)")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {cores} cores, "
          f"load average {os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "")
    headline = None
    if args.only in (None, "memory"):
        torch.set_num_threads(1)
        depths = (2, 4, 8) if args.quick else (2, 4, 8, 12)
        memory_table("Memory vs depth: FC stacks of 1024-wide Tanh layers, MNIST input (Fig. 3a)",
                     {f"L={d}": (lambda d=d: fc_stack(d), d) for d in depths}, batch_size=64)
        headline = (list(COMPARISONS)[-1], MEMORY_COLUMNS[1])
        memory_table("Memory: the paper's convnets, MNIST input (App. H.2; K=L means K=3 here)",
                     {"ConvS": (lambda: load_model("convs"), 3), "ConvL": (lambda: load_model("convl"), 3)}, batch_size=64)
    if args.only in (None, "throughput"):
        warmup, repeats = (2, 5) if args.quick else (3, 12)
        throughput_table(args.model, 4, warmup, args.repeats or repeats, cores)
        headline = (list(COMPARISONS)[-1], TIME_COLUMNS[1])
    if args.only in (None, "cuda"):
        # The paper's streaming setting is batch 4 (Sec. 5.4); its appendix sweeps larger batches, where the
        # kernels are long enough that launches do not dominate.
        for batch_size in args.cuda_batch_sizes:
            if cuda_table(args.model, batch_size, 5, args.repeats or 30):
                headline = headline or (list(COMPARISONS)[-1], TIME_COLUMNS[1])
    if headline:
        write_outputs(args, headline, cores=cores, torch=torch.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
