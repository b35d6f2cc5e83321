"""Checks of the distributed engine, launched with torchrun (the multi-process tests run this):

    PYTHONPATH=tests/distributed/workers torchrun --nproc_per_node 4 -m subnet_selfcheck --overlap 2 --json out.json

For each masking kind, on every rank:
  sync        after every one of `--steps` training steps, every shared parameter entry is identical
              across its owners (max |difference| over each owner group), and the unified model equals
              the single-process simulation (method.SubnetDPSimulation) of the same N workers, step by step;
  bytes       this rank's parameter, gradient (mid-step) and optimizer-state bytes, next to the full
              model's and the plan's count;
  engines     the "groups" and "dense" averaging engines give the same averaged gradient;
  divide_by_p worker 0 sends an all-zero gradient (a dead-ReLU worker) and every other worker sends its
              rank + 1: each entry must be sum / (owner count), not sum / (workers that sent non-zeros).
And once, with P = N: `ddp` -- the subnetwork engine and torch's DistributedDataParallel on the same data
give the same weights after N steps.

Rank 0 writes every rank's findings (JSON); the exit status is 0 whatever they are (the tests judge).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from edgetrain.data.arrays import ArrayStream
from edgetrain.recipes.subnet_dp.averaging import MaskedAverager, gather_full_state
from edgetrain.recipes.subnet_dp.config import SubnetDPConfig, make_optimizer, model_config_for, plan_for
from edgetrain.methods.subnet_dp.method import SubnetDPSimulation
from edgetrain.methods.subnet_dp.subnetwork import materialise_subnetwork, state_bytes
from edgetrain.models.resnet_subnet import build_subnet_resnet, digits_subnet_config


def synthetic_data(size: int = 256, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(size, 1, 8, 8, generator=generator), torch.randint(0, 10, (size,), generator=generator)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def check_masking(masking: str, overlap: int, steps: int, batch_size: int, width: int) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = SubnetDPConfig(masking=masking, overlap=overlap, batch_size=batch_size, lr=0.05, warmup_fraction=0.0)
    model_config = model_config_for(digits_subnet_config(width=width), masking, world, overlap)
    plan = plan_for(model_config, config, world)
    subnet = materialise_subnetwork(model_config, plan, rank)
    optimizer, scheduler = make_optimizer(subnet.parameters(), config, steps)
    averager = MaskedAverager(subnet, engine="groups")
    # The same N workers simulated in this process, on the same full model and data.
    full = build_subnet_resnet(model_config)
    simulation = SubnetDPSimulation(full, num_workers=world, overlap=overlap, masking=masking,
                                    mask_seed=config.mask_seed)
    sim_optimizer, sim_scheduler = make_optimizer(full.parameters(), config, steps)
    x, y = synthetic_data()
    stream = ArrayStream(x, y, batch_size=batch_size * world, shuffle=True, seed=0)

    out: dict[str, Any] = {"masking": masking, "rank": rank, "overlap": overlap, "num_workers": world,
                           "owner_discrepancy_per_step": [], "simulation_gap_per_step": []}
    with torch.device("meta"):
        meta = build_meta(model_config)
    out["plan_worker_parameters"] = plan.worker_parameter_count(meta, rank)
    out["replicated_fraction"] = plan.replicated_fraction(meta)
    out["branch_load"] = plan.branch_load(rank)  # this rank's share of the residual-branch parameters
    for step in range(steps):
        batch = stream.batch(step)
        rows = slice(rank * batch_size, (rank + 1) * batch_size)
        loss = F.cross_entropy(subnet(batch.inputs[rows]), batch.targets[rows])
        loss.backward()
        if step == 0:
            out["engines_max_diff"] = _compare_engines(subnet, averager)
        averager.average()
        optimizer.step()
        if step == 0:  # gradients and momentum both live now: each must be the subnetwork's size
            out["state_bytes_mid_step"] = state_bytes(subnet, optimizer)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        simulation.step(batch, sim_optimizer)
        sim_scheduler.step()
        out["owner_discrepancy_per_step"].append(averager.owner_discrepancy())
        unified = gather_full_state(subnet)
        out["simulation_gap_per_step"].append(_max_diff(unified, dict(full.named_parameters())))
    held = state_bytes(subnet, optimizer)
    full_params = sum(p.numel() * p.element_size() for p in full.parameters())
    out["state_bytes"] = held
    out["worker_parameters"] = sum(p.numel() for p in subnet.parameters())
    out["param_plus_optimizer_ratio"] = (held["parameters"] + held["optimizer"]) / (2 * full_params)
    out["divide_by_p"] = _check_divide_by_p(subnet, averager, plan)
    return out


def build_meta(model_config):
    from edgetrain.models.resnet import ResNet

    return ResNet(model_config)


def _compare_engines(subnet, averager: MaskedAverager) -> float:
    raw = {n: p.grad.clone() for n, p in subnet.named_parameters()}
    averager.average()
    grouped = {n: p.grad.clone() for n, p in subnet.named_parameters()}
    for n, p in subnet.named_parameters():
        p.grad.copy_(raw[n])
    averager.average(engine="dense")
    gap = _max_diff(grouped, {n: p.grad for n, p in subnet.named_parameters()})
    for n, p in subnet.named_parameters():
        p.grad.copy_(raw[n])  # leave the raw gradients for the real step
    return gap


def _check_divide_by_p(subnet, averager: MaskedAverager, plan) -> dict[str, float]:
    rank = dist.get_rank()
    value = lambda worker: 0.0 if worker == 0 else float(worker + 1)  # noqa: E731  worker 0: dead, sends zeros
    result = {}
    for engine in ("groups", "dense"):
        for p in subnet.parameters():
            p.grad = torch.full_like(p, value(rank))
        averager.average(engine=engine)
        worst_vs_owner_count, worst_vs_nonzero = 0.0, 0.0
        for name, p in subnet.named_parameters():
            shape = subnet.full_shapes[name]
            total = torch.zeros(shape)
            senders = torch.zeros(shape)
            for worker in range(plan.num_workers):
                mask = plan.parameter_mask(name, shape, worker).float()
                total += mask * value(worker)
                senders += mask * (value(worker) != 0)
            by_owners = subnet.from_full(name, total / plan.owner_count(name))
            by_senders = subnet.from_full(name, total / senders.clamp_min(1))
            worst_vs_owner_count = max(worst_vs_owner_count, float((p.grad - by_owners).abs().max()))
            worst_vs_nonzero = max(worst_vs_nonzero, float((p.grad - by_senders).abs().max()))
        result[f"{engine}_max_error"] = worst_vs_owner_count
        result[f"{engine}_gap_to_nonzero_count"] = worst_vs_nonzero
        for p in subnet.parameters():
            p.grad = None
    return result


def check_ddp_parity(steps: int, batch_size: int, width: int) -> dict[str, Any]:
    """P = N through the subnetwork engine vs torch DDP, same init, data and optimizer."""
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    config = SubnetDPConfig(masking="block", overlap=world, batch_size=batch_size, lr=0.05)
    model_config = model_config_for(digits_subnet_config(width=width), "block", world, world)
    plan = plan_for(model_config, config, world)
    subnet = materialise_subnetwork(model_config, plan, rank)
    optimizer, scheduler = make_optimizer(subnet.parameters(), config, steps)
    averager = MaskedAverager(subnet)
    ddp_model = DistributedDataParallel(build_subnet_resnet(model_config))
    ddp_optimizer, ddp_scheduler = make_optimizer(ddp_model.parameters(), config, steps)
    x, y = synthetic_data()
    stream = ArrayStream(x, y, batch_size=batch_size * world, shuffle=True, seed=1)
    for step in range(steps):
        batch = stream.batch(step)
        rows = slice(rank * batch_size, (rank + 1) * batch_size)
        F.cross_entropy(subnet(batch.inputs[rows]), batch.targets[rows]).backward()
        averager.average()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(ddp_model(batch.inputs[rows]), batch.targets[rows]).backward()
        ddp_optimizer.step()
        ddp_scheduler.step()
        ddp_optimizer.zero_grad(set_to_none=True)
    ours = dict(subnet.named_parameters())
    theirs = dict(ddp_model.module.named_parameters())
    initial = build_subnet_resnet(model_config).named_parameters()
    moved = max(float((theirs[n].detach() - p).abs().max()) for n, p in initial)
    return {"rank": rank, "steps": steps, "max_weight_diff": _max_diff({n: p.detach() for n, p in ours.items()},
                                                                        {n: p.detach() for n, p in theirs.items()}),
            "weights_moved_by": moved}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m subnet_selfcheck")
    parser.add_argument("--overlap", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--maskings", default="block,neuron")
    parser.add_argument("--no-ddp", dest="ddp", action="store_false")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    try:
        found: dict[str, Any] = {"maskings": {}}
        for masking in args.maskings.split(","):
            found["maskings"][masking] = check_masking(masking, args.overlap, args.steps, args.batch_size, args.width)
        if args.ddp:
            found["ddp"] = check_ddp_parity(dist.get_world_size(), args.batch_size, args.width)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, found)
        if dist.get_rank() == 0:
            text = json.dumps(everyone, indent=1)
            if args.json is not None:
                from edgetrain.training.checkpoint import atomic_write_bytes

                atomic_write_bytes(text.encode("utf-8"), args.json)
            else:
                print(text)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
