"""torchrun entry point of subnetwork data parallelism.

    torchrun --nproc_per_node 4 -m edgetrain.recipes.subnet_dp.run --dataset digits \\
        --masking block --overlap 2 --epochs 30 --json result.json

N is the number of processes. gloo on CPU (the default), nccl with --device cuda (one GPU per rank,
cuda:LOCAL_RANK). Rank 0 prints one JSON line per rank's result (and writes them all to --json).
`launch_local(N, [...])` does the same from Python: it starts torchrun on localhost in a subprocess
and returns the parsed results.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from edgetrain.distributed.launch import run_torchrun

DATASETS = ("digits", "fashion-mnist", "random-cifar")


def build_parser() -> argparse.ArgumentParser:
    from edgetrain.recipes.subnet_dp.config import SCHEDULERS

    parser = argparse.ArgumentParser(prog="python -m edgetrain.recipes.subnet_dp.run",
                                     description="Subnetwork data parallelism (launch with torchrun)")
    parser.add_argument("--dataset", choices=DATASETS, default="digits")
    parser.add_argument("--data-file", type=Path, default=None,
                        help="a torch.save'd ((x_train, y_train), (x_test, y_test)) to use instead of --dataset "
                             "(saves every rank loading the data set; see save_data_file)")
    parser.add_argument("--train-limit", type=int, default=None, help="use only the first K training examples")
    parser.add_argument("--masking", choices=("block", "neuron"), default="block")
    parser.add_argument("--overlap", type=int, default=None, help="P, owners per parameter (default N: plain DP)")
    parser.add_argument("--width", type=int, default=None, help="first-stage channels (digits 8, CIFAR 64)")
    parser.add_argument("--blocks", type=str, default="2,2,2,2", help="BasicBlocks per stage")
    parser.add_argument("--epochs", type=float, default=30.0, help="DP epochs (x N/P when FLOP-matched)")
    parser.add_argument("--no-flop-match", dest="flop_matched", action="store_false")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=16, help="per worker")
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--lr-min", type=float, default=0.002)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--scheduler", choices=SCHEDULERS, default="cosine")
    parser.add_argument("--milestones", type=str, default="0.5,0.75")
    parser.add_argument("--engine", choices=("groups", "dense"), default="groups")
    parser.add_argument("--mask-seed", type=int, default=0)
    parser.add_argument("--load-slack", type=float, default=None,
                        help="block masking: no worker holds more than (1 + S) x the balance-first assignment's "
                             "heaviest; within that, owners that leave the fewest branch pairs untrained together "
                             "(edgetrain.methods.subnet_dp.assign); default 0.2, 0 for balance first")
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--model-seed", type=int, default=0)
    parser.add_argument("--check-sync", type=int, default=0, help="check owners agree every K steps")
    parser.add_argument("--memory", action="store_true", help="measure this rank's peak memory (linux / cuda probe)")
    parser.add_argument("--no-eval", dest="evaluate", action="store_false")
    parser.add_argument("--ddp", action="store_true", help="train the full model with torch DDP instead (baseline)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", type=Path, default=None, help="rank 0 writes every rank's result here")
    return parser


def load_data(name: str, train_limit: int | None = None, seed: int = 0, data_file: Path | None = None):
    """((x_train, y_train), (x_test, y_test)) as images [B, C, H, W]."""
    if data_file is not None:
        train, test = torch.load(data_file)
    elif name == "digits":
        from edgetrain.data.digits import load_digits_split

        train = load_digits_split("train", image=True)
        test = load_digits_split("test", image=True)
    elif name == "fashion-mnist":
        from edgetrain.data.fashion_mnist import load_fashion_mnist

        train = load_fashion_mnist("train", image=True)
        test = load_fashion_mnist("test", image=True)
    else:  # random CIFAR-shaped data: for memory and timing, not accuracy
        generator = torch.Generator().manual_seed(seed)
        size = train_limit or 4096
        train = (torch.rand(size, 3, 32, 32, generator=generator), torch.randint(0, 10, (size,), generator=generator))
        test = (train[0][:256], train[1][:256])
    if train_limit is not None:
        train = (train[0][:train_limit], train[1][:train_limit])
    return train, test


def model_config_from(args: argparse.Namespace, in_channels: int):
    from edgetrain.models.resnet_subnet import SubnetResNetConfig

    blocks = tuple(int(b) for b in args.blocks.split(","))
    width = args.width or (64 if args.dataset == "random-cifar" else 8)
    return SubnetResNetConfig(num_classes=10, in_channels=in_channels, stem="cifar", width=width,
                              blocks_per_stage=blocks, seed=args.model_seed)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from edgetrain.recipes.subnet_dp.trainer import SubnetDPConfig, train_ddp_baseline, train_subnet_dp
    from edgetrain.utils.logs import configure_cli_logging, get_logger

    configure_cli_logging()
    log = get_logger(__name__)
    if "RANK" not in os.environ:
        log.error("run this under torchrun, e.g. torchrun --nproc_per_node 4 -m edgetrain.recipes.subnet_dp.run ...")
        return 2
    probe = None
    if args.memory and args.device == "cpu":
        from edgetrain.probes import LinuxProbe, fix_malloc_mmap_threshold

        fix_malloc_mmap_threshold()  # before tensors are allocated: every freed block goes back to the kernel
        probe = LinuxProbe()
        ok, why = probe.available()
        if not ok:
            log.warning("linux probe unavailable (%s); falling back to no measured memory", why)
            probe = None
    device = "cpu"
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
        if args.memory:
            from edgetrain.probes import CudaProbe

            probe = CudaProbe()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        train, test = load_data(args.dataset, args.train_limit, args.data_seed, args.data_file)
        config = SubnetDPConfig(masking=args.masking, overlap=args.overlap, mask_seed=args.mask_seed,
                                load_slack=args.load_slack, data_seed=args.data_seed, batch_size=args.batch_size,
                                epochs=args.epochs,
                                flop_matched=args.flop_matched, lr=args.lr, lr_min=args.lr_min,
                                weight_decay=args.weight_decay, scheduler=args.scheduler,
                                milestones=tuple(float(m) for m in args.milestones.split(",")),
                                engine=args.engine, check_sync_every=args.check_sync, max_steps=args.max_steps)
        trainer = train_ddp_baseline if args.ddp else train_subnet_dp
        result = trainer(model_config_from(args, train[0].shape[1]), train, test if args.evaluate else None, config,
                         device=device, probe=probe)
        results: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(results, result.to_dict())
        if dist.get_rank() == 0:
            for item in results:
                print(json.dumps(item), flush=True)
            if args.json is not None:
                from edgetrain.training.checkpoint import atomic_write_json

                atomic_write_json(results, args.json)
    finally:
        dist.destroy_process_group()
    return 0


def save_data_file(path: Path, name: str = "digits", train_limit: int | None = None, seed: int = 0) -> Path:
    """Load a data set once and save it for --data-file (N ranks importing scikit-learn at once is slow)."""
    from edgetrain.training.checkpoint import atomic_torch_save

    return atomic_torch_save(load_data(name, train_limit, seed), path)


def launch_local(num_workers: int, argv: Sequence[str], *, module: str = "edgetrain.recipes.subnet_dp.run",
                 timeout: float = 600, threads_per_worker: int = 1) -> list[dict[str, Any]]:
    """Run `module` under torchrun with N processes on localhost (edgetrain.distributed.launch) and return
    rank 0's JSON list. Children get OMP_NUM_THREADS=threads_per_worker (N processes share the cores)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        proc = run_torchrun(num_workers, module, [*argv, "--json", str(out)], timeout=timeout,
                            threads_per_worker=threads_per_worker)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"torchrun {module} with {num_workers} workers failed (exit {proc.returncode}):\n"
                               f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        return json.loads(out.read_text())


if __name__ == "__main__":
    sys.exit(main())
