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
module's activations and JVPs each. Usage:

  .venv/bin/python tools/bench_fgd.py                 # everything (a few minutes on 2 cores)
  .venv/bin/python tools/bench_fgd.py --quick         # smaller sweep, fewer timed steps
  .venv/bin/python tools/bench_fgd.py --only memory   # or throughput, cuda
"""
from __future__ import annotations

import argparse
import json
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
from edgetrain.probes.tensors import TensorAccountant  # noqa: E402

MIB = 2**20


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
    close = getattr(learner.method, "close", None)
    if close:
        close()
    return {"weights": weights, "total": peak, "above": peak - weights}


def memory_variants(num_modules: int) -> dict[str, tuple[str, dict]]:
    return {"bp": ("bp", {}),
            "fgd": ("fgd", {}),
            "fgd (no tangent ckpt)": ("fgd", {"tangent_checkpoint": False}),
            f"asyncfgd K={num_modules}": ("asyncfgd", {"num_modules": num_modules, "runtime": "reference"}),
            f"asyncfgd K={num_modules} (no tangent ckpt)": ("asyncfgd", {"num_modules": num_modules,
                                                                        "runtime": "reference",
                                                                        "tangent_checkpoint": False})}


def memory_table(title: str, columns: dict[str, tuple[Callable[[], nn.Module], int]], batch_size: int) -> dict:
    print(f"\n{title} (batch {batch_size}; MiB by tensor accounting; x = ratio to bp)")
    rows: dict[str, dict[str, dict]] = {}
    for column, (build, num_modules) in columns.items():
        for label, (method, options) in memory_variants(num_modules).items():
            label = label.replace(f"K={num_modules}", "K=L")
            print(f"  {column}: {label} ...", file=sys.stderr, flush=True)
            rows.setdefault(label, {})[column] = step_memory(build, method, options, batch_size)
    print(f"{'':<34}" + "".join(f"{c:>32}" for c in columns))
    print(f"{'method':<34}" + "".join(f"{'total MiB (x)   above MiB (x)':>32}" for _ in columns))
    for label, cells in rows.items():
        line = f"{label:<34}"
        for column in columns:
            cell, ref = cells[column], rows["bp"][column]
            line += (f"{cell['total'] / MIB:>10.2f} ({cell['total'] / ref['total']:.2f})"
                     f"{cell['above'] / MIB:>11.2f} ({cell['above'] / ref['above']:.2f})")
        print(line)
    print("K=L: one module per hidden layer (embed joins the first, the head the last).")
    return rows


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


def time_steps(step: Callable[[Batch], object], batch: Batch, warmup: int, steps: int, sync: Callable[[], None]) -> dict:
    for _ in range(warmup):
        step(batch)
    sync()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step(batch)
        sync()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {"median_s": median, "steps_per_s": 1 / median, "times": times}


def throughput_table(model_name: str, batch_size: int, warmup: int, steps: int, cores: int) -> dict:
    print(f"\nThroughput: {model_name}, stream batch {batch_size}, {cores} cores available "
          f"(median of {steps} steps after {warmup} warm-up; a shared machine: figures are noisy)")
    rows = {}
    default_threads = torch.get_num_threads()

    def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = load_model(model_name)
        return model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def run_method(label: str, threads: int, method: Callable[[nn.Module], object]) -> None:
        print(f"  {label} ...", file=sys.stderr, flush=True)
        torch.set_num_threads(threads)
        model, optimizer = fresh()
        trainer = method(model)
        batch = random_batch(model, batch_size)
        rows[label] = time_steps(lambda b: trainer.step(b, optimizer), batch, warmup, steps, lambda: None)
        if hasattr(trainer, "close"):
            trainer.close()

    run_method("fgd, 1 worker x 1 thread", 1, lambda m: edgetrain.methods.fgd.ForwardGradient(m))
    run_method(f"fgd, 1 worker x {cores} threads", cores, lambda m: edgetrain.methods.fgd.ForwardGradient(m))
    run_method("asyncfgd K=2, 2 workers x 1 thread", 1, lambda m: AsyncFGD(m, num_modules=2, runtime="threads"))
    run_method("sync pipeline K=2 (micro-batch 1)", 1, lambda m: SyncPipeline(m, 2, micro_batch=1))
    run_method("asyncfgd K=2, sequential (1 thread)", 1, lambda m: AsyncFGD(m, num_modules=2, runtime="reference"))
    torch.set_num_threads(default_threads)
    base = rows["fgd, 1 worker x 1 thread"]["median_s"]
    both = rows[f"fgd, 1 worker x {cores} threads"]["median_s"]
    print(f"{'configuration':<40}{'ms/step':>10}{'steps/s':>10}{'vs 1x1':>9}{f'vs 1x{cores}':>9}")
    for label, row in rows.items():
        print(f"{label:<40}{row['median_s'] * 1e3:>10.1f}{row['steps_per_s']:>10.2f}"
              f"{base / row['median_s']:>8.2f}x{both / row['median_s']:>8.2f}x")
    return rows


def cuda_table(model_name: str, batch_size: int, warmup: int, steps: int) -> dict | None:
    if not torch.cuda.is_available():
        print("\nCUDA streams: skipped -- no CUDA device here (run this on a Jetson / GPU machine: "
              "asyncfgd K=2 with runtime='cuda-streams' vs fgd on the same GPU)")
        return None
    print(f"\nCUDA streams: {model_name} on {torch.cuda.get_device_name()}, batch {batch_size}")
    rows = {}
    for label, make in {"fgd (one stream)": lambda m: edgetrain.methods.fgd.ForwardGradient(m),
                        "asyncfgd K=2, 2 CUDA streams": lambda m: AsyncFGD(m, num_modules=2, runtime="cuda-streams"),
                        "asyncfgd K=2, sequential": lambda m: AsyncFGD(m, num_modules=2, runtime="reference")}.items():
        model = load_model(model_name, device="cuda")
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
        trainer = make(model)
        batch = random_batch(model, batch_size).to("cuda")
        rows[label] = time_steps(lambda b: trainer.step(b, optimizer), batch, warmup, steps, torch.cuda.synchronize)
        if hasattr(trainer, "close"):
            trainer.close()
    base = rows["fgd (one stream)"]["median_s"]
    for label, row in rows.items():
        print(f"{label:<40}{row['median_s'] * 1e3:>10.2f} ms/step{base / row['median_s']:>8.2f}x")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sweep, fewer timed steps")
    parser.add_argument("--only", choices=("memory", "throughput", "cuda"), default=None)
    parser.add_argument("--model", default="resnet18-cifar", help="throughput model (default resnet18-cifar)")
    parser.add_argument("--json", default=None, help="write every record here")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {cores} cores, "
          f"load average {os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "")
    everything: dict = {}
    if args.only in (None, "memory"):
        torch.set_num_threads(1)
        depths = (2, 4, 8) if args.quick else (2, 4, 8, 12)
        everything["fc_depth"] = memory_table(
            "Memory vs depth: FC stacks of 1024-wide Tanh layers, MNIST input (Fig. 3a)",
            {f"L={d}": (lambda d=d: fc_stack(d), d) for d in depths}, batch_size=64)
        everything["convnets"] = memory_table(
            "Memory: the paper's convnets, MNIST input (App. H.2; K=L means K=3 here)",
            {"ConvS": (lambda: load_model("convs"), 3), "ConvL": (lambda: load_model("convl"), 3)}, batch_size=64)
    if args.only in (None, "throughput"):
        warmup, steps = (2, 5) if args.quick else (3, 12)
        everything["throughput"] = throughput_table(args.model, 4, warmup, steps, cores)
    if args.only in (None, "cuda"):
        everything["cuda"] = cuda_table(args.model, 4, 5, 30)
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
