"""Pipelined SCPL: one worker process per component on torch.distributed (SCPL §3.4, Fig. 3).

    torchrun --standalone --nproc_per_node 2 -m edgetrain.recipes.scpl_pipeline \\
        --model convnet-digits --data digits --batch 32 --steps 200 --optimizer adam --lr 1e-3 \\
        --method-options '{"views": 1}' --save weights.safetensors --report report.json

Worker l holds component l (its units, and its projection head or, for the last worker, the model's
head). Every step:

    worker 0:  batch from the stream -> views (augmented on this worker) -> split into micro-batches
    worker l:  receive the targets and each micro-batch's r_{l-1} from worker l-1
               r_l = f_l(r_{l-1}) per micro-batch, each sent on to worker l+1 as soon as it exists
               local loss on all of r_l (SupCon needs the whole batch), backward, optimizer step

Sends are non-blocking (point-to-point isend/irecv; gloo on CPU, nccl when every worker has its own
GPU), so worker l runs its local loss and backward while worker l+1 runs its forward on what l just
sent; worker 0 moves on to the next batch while the others still work on this one (at most
`max_in_flight` steps of sends outstanding per worker bound the queue). No gradient ever travels
between workers: the only messages are activations and labels, downstream.

Same updates as the single-process method. Worker l's gradient depends only on its input, which
worker l-1 computed with its weights from before this step's update -- exactly what the sequential
`scpl` method computes -- so after N steps the weights equal `Learner(method="scpl")`'s (same seeds,
same optimizer; the test checks it). Micro-batches (the SCPL + GPipe hybrid of appendix A.5) change
only the forward's granularity: the loss and backward still cover the whole batch, so the gradient is
the same up to float summation order -- except for BatchNorm, whose statistics become per micro-batch
(as in GPipe). Dropout draws from each worker's own RNG, so models with dropout are equal in
distribution, not bit for bit.

Every worker builds the whole model (seeded, so identically) and keeps its component on its device;
on CUDA the others stay on the CPU. `launch(config, nproc)` runs torchrun from Python (tests,
tools/bench_scpl.py) and returns rank 0's report.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from edgetrain.data.batch import Batch
from edgetrain.distributed.launch import run_torchrun
from edgetrain.distributed.p2p import Channel
from edgetrain.registry import EdgetrainError

METHODS_RUN = ("scpl", "early_exit")


@dataclass
class PipelineConfig:
    model: str = "convnet-digits"  # a preset, a checkpoint directory, or "package.module:builder"
    method: str = "scpl"
    method_options: dict[str, Any] = field(default_factory=dict)
    data: str = "digits"           # a stream name (edgetrain.data.STREAMS), or "random" (synthetic, for timing)
    data_options: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 32
    steps: int = 100
    warmup_steps: int = 0          # run first, then the clock starts (throughput excludes them)
    optimizer: str = "adam"
    lr: float = 1e-3
    optimizer_options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0                  # torch.manual_seed, as Learner(seed=0)
    micro_batches: int = 1
    max_in_flight: int = 2
    threads: int = 1               # torch intra-op threads per worker
    device: str = "auto"           # "cpu", "cuda" (one GPU per worker), "auto"
    save: str | None = None        # rank 0 writes every component's weights and buffers here
    report: str | None = None      # rank 0 writes the JSON report here
    memory: bool = False           # account tensor memory per worker (slower; not for timing)

    def __post_init__(self) -> None:
        if self.method not in METHODS_RUN:
            raise EdgetrainError(f"scpl_pipeline runs {', '.join(METHODS_RUN)}, not {self.method!r}")
        for name in ("batch_size", "micro_batches", "max_in_flight", "threads"):
            if int(getattr(self, name)) < 1:
                raise EdgetrainError(f"scpl_pipeline: {name} must be >= 1, got {getattr(self, name)}")
        if self.steps < 0 or self.warmup_steps < 0:
            raise EdgetrainError("scpl_pipeline: steps and warmup_steps must be >= 0")


def build_model(spec: str) -> torch.nn.Module:
    """load_model(spec), or `module:function` imported and called (a model defined outside the zoo;
    every worker imports it, so it must build the same weights every time -- seed it)."""
    from edgetrain.models import load_model

    if ":" in spec and not Path(spec).exists():
        import importlib

        module_name, _, function = spec.partition(":")
        return getattr(importlib.import_module(module_name), function)()
    return load_model(spec)


# -- the data -----------------------------------------------------------------------------------

def random_stream(model: torch.nn.Module, batch_size: int, seed: int) -> Iterator[Batch]:
    """Synthetic batches of the model's input shape (timing only): batch i is a function of (seed, i)."""
    from edgetrain.models.zoo import example_input

    num_classes = int(getattr(model.config, "num_classes", 10))
    index = 0
    while True:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
        inputs = example_input(model, batch_size, 64, generator=generator)
        yield Batch(inputs, torch.randint(0, num_classes, (batch_size,), generator=generator), index)
        index += 1


def make_batches(config: PipelineConfig, model: torch.nn.Module) -> Iterator[Batch]:
    if config.data == "random":
        return random_stream(model, config.batch_size, config.seed)
    from edgetrain.data import make_stream

    options = {"batch_size": config.batch_size, **config.data_options}
    return iter(make_stream(config.data, **options))


# -- memory accounting --------------------------------------------------------------------------

class SavedActivations:
    """Bytes of tensors autograd saves for backward inside the `with` (each storage once, parameters
    excluded): the activation memory a training step holds between its forward and its backward."""

    def __init__(self, exclude: list[torch.Tensor] = ()) -> None:  # type: ignore[assignment]
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.seen: set[int] = set()
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self.exclude and key not in self.seen and storage.nbytes():
            self.seen.add(key)
            self.bytes += storage.nbytes()
        return tensor

    def __enter__(self) -> "SavedActivations":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


# -- one worker ---------------------------------------------------------------------------------

def _device(config: PipelineConfig, local_rank: int) -> torch.device:
    want = config.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > local_rank else "cpu"
    if want == "cuda":
        if torch.cuda.device_count() <= local_rank:
            raise EdgetrainError(f"scpl_pipeline: worker {local_rank} has no GPU of its own "
                                 f"({torch.cuda.device_count()} visible); nccl needs one GPU per worker -- use --device cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def run_worker(config: PipelineConfig) -> dict[str, Any] | None:
    """This process's part of the pipeline (torch.distributed initialised from the torchrun environment).
    Returns rank 0's report (None on the other ranks)."""
    from edgetrain.backends.torch.optimizers import make_optimizer
    from edgetrain.data.validate import validate_batch
    from edgetrain.methods import METHODS

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _device(config, local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    model = build_model(config.model)
    options = {k: v for k, v in config.method_options.items() if k != "num_components"}
    method = METHODS.get(config.method)(model, num_components=world, **options)
    component = method.components[rank]
    for module in component.modules_for_device():
        module.to(device)
    params = component.params
    optimizer = make_optimizer(config.optimizer, list(params.values()), config.lr, **config.optimizer_options)
    channel = Channel(rank, world, device, max_pending=2 * (config.micro_batches + 1) * config.max_in_flight)
    batches = make_batches(config, model) if rank == 0 else None
    model_config = getattr(model, "config", None)

    losses: list[float] = []
    memory: dict[str, Any] = {}
    busy = 0.0

    def one_step(measure: bool) -> None:
        nonlocal busy
        if rank == 0:
            batch = next(batches)  # type: ignore[arg-type]
            validate_batch(batch, task="classify", vocab_size=getattr(model_config, "vocab_size", None),
                           num_classes=getattr(model_config, "num_classes", None))
            started = time.perf_counter()
            inputs, targets = method.batch_views(batch)
            inputs, targets = inputs.to(device), targets.to(device)
            chunks = list(torch.tensor_split(inputs, config.micro_batches))
            busy += time.perf_counter() - started
        else:
            targets = channel.recv()
            chunks = [None] * config.micro_batches  # received one at a time below
        if rank < world - 1:
            channel.send(targets)
        saved = SavedActivations(list(params.values())) if measure else None
        outputs = []
        for m, chunk in enumerate(chunks):
            h = chunk if chunk is not None else channel.recv()
            started = time.perf_counter()
            if saved is not None:
                with saved:
                    out = component.encode(h)
            else:
                out = component.encode(h)
            if rank < world - 1:
                channel.send(out.detach())
            outputs.append(out)
            busy += time.perf_counter() - started
        started = time.perf_counter()
        output = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        if saved is not None:
            with saved:
                loss = component.local_loss(output, targets)
            memory["saved_activation_bytes"] = max(memory.get("saved_activation_bytes", 0), saved.bytes)
        else:
            loss = component.local_loss(output, targets)
        if loss.requires_grad:
            loss.backward()
        del outputs, output
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        busy += time.perf_counter() - started

    for _ in range(config.warmup_steps):
        one_step(measure=False)
    channel.flush()
    dist.barrier()
    busy, channel.wait_seconds = 0.0, 0.0
    start = time.perf_counter()
    if config.memory:
        from edgetrain.probes.tensors import TensorAccountant

        accountant = TensorAccountant(device=device)
        accountant.register(*[p for p in params.values()], optimizer)
        with accountant:
            for _ in range(config.steps):
                one_step(measure=True)
            channel.flush()
        memory["tensor_peak_above_baseline_bytes"] = accountant.report().peak_above_baseline_bytes
    else:
        for _ in range(config.steps):
            one_step(measure=False)
        channel.flush()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    seconds = time.perf_counter() - start

    mine = {"rank": rank, "component": component.name, "losses": losses, "busy_seconds": busy,
            "wait_seconds": channel.wait_seconds, "memory": memory,
            "parameters": sum(p.numel() for p in params.values())}
    state = _component_state(model, component) if config.save else None
    everyone: list[Any] = [None] * world
    dist.gather_object((mine, state), everyone if rank == 0 else None, dst=0)
    if rank != 0:
        return None
    report = {"config": asdict(config), "world_size": world, "backend": dist.get_backend(), "device": str(device),
              "split": method.split, "seconds": seconds,
              "samples_per_second": config.steps * config.batch_size / seconds if seconds > 0 else None,
              "workers": [worker for worker, _ in everyone]}
    if config.save:
        from edgetrain.training.checkpoint import atomic_save_safetensors

        tensors = {}
        for _, part in everyone:
            tensors.update(part)
        atomic_save_safetensors(tensors, config.save, {"split": method.split, "steps": str(config.steps)})
    if config.report:
        from edgetrain.training.checkpoint import atomic_write_json

        atomic_write_json(report, config.report)
    return report


def _component_state(model: torch.nn.Module, component: Any) -> dict[str, torch.Tensor]:
    """The component's trainable parameters and the buffers of its modules, by model name, on the CPU."""
    state = {name: p.detach().cpu().clone() for name, p in component.params.items()}
    mine = {id(b) for m in component.modules_for_device() for b in m.buffers()}
    for name, buffer in model.named_buffers():
        if id(buffer) in mine:
            state[name] = buffer.detach().cpu().clone()
    return state


# -- launching ----------------------------------------------------------------------------------

def launch(config: PipelineConfig, nproc: int, *, timeout: float = 600, threads_env: int | None = None,
           python: str = sys.executable) -> dict[str, Any]:
    """Run the pipeline with `nproc` workers under torchrun (edgetrain.distributed.launch) and return rank 0's
    report. OMP_NUM_THREADS is set to `config.threads` in the workers."""
    with tempfile.TemporaryDirectory(prefix="scpl-pipeline-") as tmp:
        config_path, report_path = Path(tmp) / "config.json", Path(tmp) / "report.json"
        payload = asdict(config)
        payload["report"] = str(report_path)
        config_path.write_text(json.dumps(payload))
        done = run_torchrun(nproc, "edgetrain.recipes.scpl_pipeline", ["--config", str(config_path)],
                            timeout=timeout, threads_per_worker=threads_env or config.threads, python=python)
        if done.returncode != 0 or not report_path.is_file():
            raise EdgetrainError(f"scpl_pipeline with {nproc} workers failed (exit {done.returncode}):\n"
                                 f"{done.stderr[-4000:]}")
        report = json.loads(report_path.read_text())
    report["launch_attempts"] = done.attempts  # 2 when a worker died of a signal and the run was repeated
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m edgetrain.recipes.scpl_pipeline",
                                     description="Pipelined SCPL: run under torchrun, one worker per component.")
    parser.add_argument("--config", help="a JSON file of PipelineConfig fields (flags given too override it)")
    defaults = PipelineConfig()
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        elif isinstance(value, dict):
            parser.add_argument(flag, type=json.loads, default=None, help="JSON object")
        else:
            parser.add_argument(flag, type=type(value) if value is not None else str, default=None)
    parser.add_argument("--batch", dest="batch_size", type=int, default=None, help="same as --batch-size")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    values: dict[str, Any] = json.loads(Path(args.config).read_text()) if args.config else {}
    values.update({k: v for k, v in vars(args).items() if k != "config" and v is not None})
    config = PipelineConfig(**values)
    try:
        report = run_worker(config)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if report is not None and not config.report:
        summary = {k: report[k] for k in ("world_size", "backend", "split", "seconds", "samples_per_second")}
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
