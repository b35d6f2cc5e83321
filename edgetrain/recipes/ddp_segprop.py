"""SegProp / layer-wise training under torchrun with DistributedDataParallel (the server side).

Every rank holds the whole model and runs the same schedule (edgetrain.recipes.segprop_schedule); only
the stage's active path -- active segment, its adapter, the global-head units and the head -- is
wrapped in DistributedDataParallel, so gradients are all-reduced for those parameters and nothing
else (committed segments run forward-only and are identical on every rank). Each global batch of the
stream is cut into equal per-rank shards (rank r takes rows r*B/W .. (r+1)*B/W - 1); DDP averages the
shards' gradients, which is the global batch's mean gradient, so the weights equal a single process
trained on the global batch (up to float summation order). Step losses are averaged across ranks
before the method sees them, so plateau decisions agree. Backends: gloo on CPU, nccl on CUDA.

    torchrun --standalone --nproc_per_node 2 -m edgetrain.recipes.ddp_segprop \
        --model resnet18-cifar-gn --data digits ... --out weights.safetensors

BatchNorm: each rank normalises with its own shard's statistics (DDP's usual behaviour) and buffers are
broadcast from rank 0; use GroupNorm models (resnet18-cifar-gn) or SyncBatchNorm on CUDA when a run
must equal the single-process one.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from edgetrain.data.batch import Batch
from edgetrain.registry import EdgetrainError


def init_distributed(backend: str = "auto") -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes in the environment; (rank, world size, device)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise EdgetrainError("not started by torchrun (RANK / WORLD_SIZE are not set); run "
                             "`torchrun --nproc_per_node N -m edgetrain.recipes.ddp_segprop ...`")
    cuda = torch.cuda.is_available() and backend in ("auto", "nccl")
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size(), device


def shard_batch(batch: Batch, rank: int, world: int) -> Batch:
    """Rank `rank`'s equal share of a global batch (the batch size must divide by the world size)."""
    size = batch.num_samples
    if size % world:
        raise EdgetrainError(f"global batch of {size} does not split evenly over {world} ranks")
    per = size // world
    rows = slice(rank * per, (rank + 1) * per)
    return Batch(batch.inputs[rows], batch.targets[rows], batch.index)


def distributed_hooks(device: torch.device) -> Callable[[Any], None]:
    """A `configure` for run_schedule: DDP around each stage's active path, losses averaged."""
    def wrap(path: nn.Module) -> nn.Module:
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(path, device_ids=ids)

    def reduce_loss(loss: torch.Tensor) -> torch.Tensor:
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total / dist.get_world_size()

    def configure(method: Any) -> None:
        if not hasattr(method, "wrap_active"):
            raise EdgetrainError(f"method {getattr(method, 'name', '?')!r} has no active path to distribute; "
                                 "the distributed runner takes segprop and lw")
        method.wrap_active = wrap
        method.reduce_loss = reduce_loss
    return configure


def run_distributed(model: nn.Module, stream: Any, method: str = "segprop", *, backend: str = "auto",
                    checkpoint_dir: str | Path | None = None, **options: Any):
    """run_schedule on this rank: the model is moved to this rank's device, each batch sharded, the
    active path wrapped; checkpoints are written by rank 0 and read by every rank."""
    from edgetrain.recipes.segprop_schedule import run_schedule

    rank, world, device = init_distributed(backend)
    model = model.to(device)
    return run_schedule(model, stream, method, backend="torch-cuda" if device.type == "cuda" else "torch-cpu",
                        shard=lambda batch: shard_batch(batch, rank, world), configure=distributed_hooks(device),
                        checkpoint_dir=checkpoint_dir, write_checkpoints=rank == 0, **options)


# -- the torchrun entry point ----------------------------------------------------------------------

def build_model(name: str | None, resnet: str | None) -> nn.Module:
    if resnet is not None:
        from edgetrain.models.resnet import ResNetConfig, build_resnet

        return build_resnet(ResNetConfig(**json.loads(resnet)))
    from edgetrain.models import load_model

    return load_model(name or "resnet18-cifar-gn")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m edgetrain.recipes.ddp_segprop",
                                     description="SegProp / layer-wise training with DDP under torchrun")
    parser.add_argument("--method", default="segprop", choices=["segprop", "lw"])
    parser.add_argument("--model", help="a model preset (default resnet18-cifar-gn)")
    parser.add_argument("--resnet", help="a ResNetConfig as JSON instead of a preset, e.g. "
                                         "'{\"in_channels\": 1, \"width\": 8, \"norm\": \"group\"}'")
    parser.add_argument("--data", default="digits", help="a stream name (edgetrain.data.STREAMS)")
    parser.add_argument("--data-options", default="{}", help="JSON options for the stream")
    parser.add_argument("--batch-size", type=int, default=32, help="the global batch (split over ranks)")
    parser.add_argument("--epochs-per-stage", type=float, default=1.0)
    parser.add_argument("--steps-per-stage", type=int)
    parser.add_argument("--method-options", default="{}", help="JSON: head_blocks, segments, snapcheck, ...")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--out", help="rank 0 writes the final weights here (.safetensors) and a .json report")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    from edgetrain.data import make_stream

    model = build_model(args.model, args.resnet)
    stream = make_stream(args.data, batch_size=args.batch_size, **json.loads(args.data_options))
    result = run_distributed(model, stream, args.method, backend=args.backend,
                             epochs_per_stage=args.epochs_per_stage, steps_per_stage=args.steps_per_stage,
                             optimizer=args.optimizer, lr=args.lr, seed=args.seed,
                             checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                             **json.loads(args.method_options))
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0 and args.out:
        from edgetrain.training.checkpoint import atomic_save_safetensors, atomic_write_json

        out = Path(args.out)
        atomic_save_safetensors(dict(result.model.state_dict()), out)
        report = {"world_size": world, "steps": result.steps, "seconds": result.seconds, "plan": result.plan,
                  "losses": result.losses,
                  "stages": [{"stage": s.stage, "name": s.name, "steps": s.steps, "mean_loss": s.mean_loss}
                             for s in result.stages]}
        atomic_write_json(report, out.with_suffix(".json"))
    from edgetrain.utils.logs import configure_cli_logging, get_logger

    configure_cli_logging()
    get_logger(__name__).info("rank %d/%d: %d steps in %.1f s", rank, world, result.steps, result.seconds)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
