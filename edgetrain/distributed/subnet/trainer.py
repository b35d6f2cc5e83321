"""The training loop of subnetwork data parallelism (§3-4), run on every rank of a process group.

    config = SubnetDPConfig(masking="block", overlap=2, epochs=30)     # N = the world size
    result = train_subnet_dp(model_config, (x_train, y_train), (x_test, y_test), config)

Setup of §4: SGD with Nesterov momentum 0.9; cosine annealing from lr (eta_max) to lr_min after a
linear warm-up over the first 5% of iterations, or the multi-step schedule (x0.1 at given fractions
of training); FLOP-matched runs train epochs * N / P epochs (a worker does about P/N of the full
model's work per sample). Each step, the global batch of N * batch_size examples is cut into N
consecutive shards, one per rank; P = N is data parallelism (tested equal to torch DDP).

Also here: `train_simulated` (all N workers in one process, through the `subnet_dp` method, for
diagnostics and tests) and `train_stochastic_depth` (the single-worker baseline reviewers asked for:
each step drops every residual branch with probability 1 - P/N).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from edgetrain.data.arrays import ArrayStream
from edgetrain.distributed.subnet.averaging import ENGINES, MaskedAverager, gather_full_state
from edgetrain.distributed.subnet.masks import MASKINGS, ResNetLayout, SubnetPlan, assign_masks
from edgetrain.distributed.subnet.subnetwork import (dropped_block, masked_block, materialise_subnetwork,
                                                     state_bytes)
from edgetrain.models.resnet import ResNet
from edgetrain.models.resnet_subnet import SubnetResNetConfig, build_subnet_resnet
from edgetrain.registry import EdgetrainError

SCHEDULERS = ("cosine", "multistep")


@dataclass
class SubnetDPConfig:
    masking: str = "block"            # "block" or "neuron"
    overlap: int | None = None        # P; None means P = N (data parallelism)
    mask_seed: int = 0
    load_slack: float | None = None   # block masking's memory cap (masks.assign_masks); None: the default 0.2
    data_seed: int = 0
    batch_size: int = 16              # per worker
    epochs: float = 30.0              # of the DP run; FLOP-matched runs take N / P times as many
    flop_matched: bool = True
    lr: float = 0.2                   # eta_max
    lr_min: float = 0.002             # eta_min of the cosine schedule
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 5e-4
    warmup_fraction: float = 0.05
    scheduler: str = "cosine"
    milestones: tuple[float, ...] = (0.5, 0.75)  # fractions of training (multistep)
    gamma: float = 0.1
    engine: str = "groups"
    check_sync_every: int = 0         # >0: assert owners agree every k steps (a collective per bucket)
    max_steps: int | None = None      # cut the run short (tests, benchmarks)

    def __post_init__(self) -> None:
        self.milestones = tuple(self.milestones)
        if self.masking not in MASKINGS:
            raise EdgetrainError(f"masking must be one of {', '.join(MASKINGS)}, got {self.masking!r}")
        if self.scheduler not in SCHEDULERS:
            raise EdgetrainError(f"scheduler must be one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}")
        if self.engine not in ENGINES:
            raise EdgetrainError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.batch_size <= 0 or self.epochs <= 0 or self.lr <= 0:
            raise EdgetrainError("batch_size, epochs and lr must be positive")
        if not all(0.0 < m < 1.0 for m in self.milestones):
            raise EdgetrainError(f"milestones are fractions of training in (0, 1), got {self.milestones}")

    def overlap_for(self, num_workers: int) -> int:
        overlap = num_workers if self.overlap is None else self.overlap
        if not 1 <= overlap <= num_workers:
            raise EdgetrainError(f"overlap P={overlap} must be in 1..N={num_workers}")
        return overlap


def lr_factor(step: int, total: int, config: SubnetDPConfig) -> float:
    """lr(step) / lr: linear warm-up over the first warmup_fraction of steps, then cosine to lr_min or
    multi-step decay."""
    warmup = int(round(config.warmup_fraction * total))
    if step < warmup:
        return (step + 1) / warmup
    if config.scheduler == "cosine":
        progress = (step - warmup) / max(1, total - warmup)
        floor = config.lr_min / config.lr
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    passed = sum(step >= round(m * total) for m in config.milestones)
    return config.gamma ** passed


def make_optimizer(params, config: SubnetDPConfig, total_steps: int):
    optimizer = torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, nesterov=config.nesterov,
                                weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, config))
    return optimizer, scheduler


def epochs_to_run(config: SubnetDPConfig, num_workers: int, overlap: int) -> float:
    return config.epochs * (num_workers / overlap if config.flop_matched else 1.0)


def total_steps(config: SubnetDPConfig, num_workers: int, overlap: int, train_size: int) -> int:
    per_epoch = train_size // (config.batch_size * num_workers)
    if per_epoch == 0:
        raise EdgetrainError(f"{train_size} training examples: too few for one global batch of "
                             f"{config.batch_size} x {num_workers}")
    steps = int(math.ceil(epochs_to_run(config, num_workers, overlap) * per_epoch))
    return steps if config.max_steps is None else min(steps, config.max_steps)


def model_config_for(model_config: SubnetResNetConfig, masking: str, num_workers: int,
                     overlap: int) -> SubnetResNetConfig:
    """The §4 init: neuron masking's conv1 fan-out counts the P/N of output channels a worker keeps."""
    fraction = overlap / num_workers if masking == "neuron" else 1.0
    return replace(model_config, masked_fan_out_fraction=fraction)


def layout_of(model_config: SubnetResNetConfig) -> ResNetLayout:
    with torch.device("meta"):
        return ResNetLayout.of(ResNet(model_config))


@torch.no_grad()
def evaluate(model: nn.Module, features: torch.Tensor, labels: torch.Tensor, batch_size: int = 256) -> dict[str, float]:
    """Top-1 accuracy and mean cross-entropy of `model` (eval mode) on (features, labels)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    correct, loss = 0, 0.0
    for start in range(0, len(features), batch_size):
        x, y = features[start:start + batch_size].to(device), labels[start:start + batch_size].to(device)
        logits = model(x)
        loss += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(-1) == y).sum())
    model.train(was_training)
    return {"accuracy": correct / len(features), "loss": loss / len(features)}


def unified_branch_scale(plan: SubnetPlan) -> float:
    """Stochastic depth's test-time rule carried over to block masking: each residual branch of the
    unified model is scaled by the fraction of workers that train it, P/N. (Neuron masking needs no
    rule: norm2 renormalises conv2's output whatever the number of hidden channels.)"""
    return plan.overlap / plan.num_workers if plan.kind == "block" else 1.0


@torch.no_grad()
def _logits(model: nn.Module, x: torch.Tensor, branch_scale: float = 1.0) -> torch.Tensor:
    if branch_scale == 1.0:
        return model(x)
    h = model.embed(x)
    for block in model.blocks:
        h = masked_block(block, h, None, branch_scale)
    return model.head(h)


@torch.no_grad()
def evaluate_logits(logits_of: Callable[[torch.Tensor], torch.Tensor], features: torch.Tensor,
                    labels: torch.Tensor, batch_size: int = 256) -> tuple[dict[str, float], torch.Tensor]:
    """Accuracy and mean cross-entropy of a logits function; also returns the softmax probabilities."""
    probs, loss, correct = [], 0.0, 0
    for start in range(0, len(features), batch_size):
        y = labels[start:start + batch_size]
        logits = logits_of(features[start:start + batch_size]).float().cpu()
        loss += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(-1) == y).sum())
        probs.append(logits.softmax(-1))
    return {"accuracy": correct / len(features), "loss": loss / len(features)}, torch.cat(probs)


def _accuracy(probs: torch.Tensor, labels: torch.Tensor) -> float:
    return float((probs.argmax(-1) == labels).float().mean())


@dataclass
class SubnetDPResult:
    rank: int
    num_workers: int
    overlap: int
    masking: str
    steps: int
    epochs: float
    plan_fingerprint: str
    worker_parameters: int               # parameters this rank materialised
    full_parameters: int
    state_bytes: dict[str, int]          # this rank's parameters / gradients / optimizer state
    full_state_bytes: dict[str, int]     # what the full model would hold (parameters, gradients, momentum)
    payload_bytes_per_step: int          # handed to all_reduce by this rank
    wire_bytes_per_step: int             # a ring all-reduce's sent bytes for that payload
    seconds_per_step: float              # median over the run (after the first 3 steps)
    final_loss: float                    # mean over ranks of the last 10 steps' local loss
    # test: the unified full model (every branch, every channel), as the paper trains it;
    # test_branch_scaled: the same with branches x P/N (block masking; stochastic depth's test rule);
    # test_subnetwork: this rank's own subnetwork; test_ensemble: the N subnetworks' mean softmax.
    test: dict[str, float] = field(default_factory=dict)
    test_branch_scaled: dict[str, float] = field(default_factory=dict)
    test_subnetwork: dict[str, float] = field(default_factory=dict)
    test_ensemble: dict[str, float] = field(default_factory=dict)
    max_owner_discrepancy: float | None = None
    memory: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _shard(batch_inputs: torch.Tensor, batch_targets: torch.Tensor, rank: int, per_worker: int):
    rows = slice(rank * per_worker, (rank + 1) * per_worker)
    return batch_inputs[rows], batch_targets[rows]


def train_subnet_dp(model_config: SubnetResNetConfig, train: tuple[torch.Tensor, torch.Tensor],
                    test: tuple[torch.Tensor, torch.Tensor] | None, config: SubnetDPConfig, *,
                    device: str | torch.device = "cpu", probe: Any = None,
                    on_step: Callable[[int, nn.Module, float], None] | None = None) -> SubnetDPResult:
    """Train on this rank's subnetwork inside an initialised process group (world size N).

    `probe`, a memory probe (edgetrain.probes), is reset before the subnetwork is built and read after
    the last step, so `result.memory` holds this rank's measured training peak. The unified full model
    is assembled afterwards (one full copy per rank, outside the measured window) to evaluate `test`."""
    if not dist.is_initialized():
        raise EdgetrainError("train_subnet_dp runs inside a process group: launch with torchrun "
                             "(python -m edgetrain.distributed.subnet.run) or call init_process_group first")
    rank, world = dist.get_rank(), dist.get_world_size()
    overlap = config.overlap_for(world)
    model_config = model_config_for(model_config, config.masking, world, overlap)
    plan = plan_for(model_config, config, world)
    fingerprints: list[Any] = [None] * world
    dist.all_gather_object(fingerprints, plan.fingerprint())
    if len(set(fingerprints)) != 1:
        raise EdgetrainError(f"ranks built different mask plans {fingerprints}: same seed, model and N on every rank?")

    memory: dict[str, Any] = {}
    if probe is not None:
        from edgetrain.probes.base import settle_memory

        settle_memory()
        probe.reset_peak()
        memory["baseline_bytes"] = probe.current_bytes()
    subnet = materialise_subnetwork(model_config, plan, rank, device=device)
    steps = total_steps(config, world, overlap, len(train[0]))
    optimizer, scheduler = make_optimizer(subnet.parameters(), config, steps)
    averager = MaskedAverager(subnet, engine=config.engine)
    stream = ArrayStream(train[0], train[1], batch_size=config.batch_size * world, shuffle=True, seed=config.data_seed)

    cuda = torch.device(device).type == "cuda"
    times, losses, worst = [], [], None
    payload = wire = 0
    for step in range(steps):
        batch = stream.batch(step)
        x, y = _shard(batch.inputs, batch.targets, rank, config.batch_size)
        x, y = x.to(device), y.to(device)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = F.cross_entropy(subnet(x), y)
        loss.backward()
        stats = averager.average()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        payload, wire = stats["payload_bytes"], stats["wire_bytes"]
        losses.append(float(loss.detach()))
        if config.check_sync_every and (step + 1) % config.check_sync_every == 0:
            gap = averager.owner_discrepancy()
            worst = gap if worst is None else max(worst, gap)
        if on_step is not None:
            on_step(step, subnet, float(loss.detach()))
    held = state_bytes(subnet, optimizer)
    if probe is not None:
        memory.update(probe=probe.name, peak_bytes=probe.peak_bytes())
        memory["peak_above_baseline_bytes"] = max(0, memory["peak_bytes"] - memory["baseline_bytes"])
    tail = torch.tensor(sum(losses[-10:]) / max(1, len(losses[-10:])), device=device)
    dist.all_reduce(tail)
    full_state = gather_full_state(subnet)
    full_parameters = sum(t.numel() for t in full_state.values())
    element = next(subnet.parameters()).element_size()
    full_bytes = {"parameters": full_parameters * element, "gradients": full_parameters * element,
                  "optimizer": full_parameters * element if config.momentum else 0}
    metrics: dict[str, dict[str, float]] = {}
    if test is not None:
        x_test = test[0].to(device)
        subnet.eval()
        metrics["test_subnetwork"], probs = evaluate_logits(subnet, x_test, test[1])
        probs = probs.to(device)
        dist.all_reduce(probs)
        metrics["test_ensemble"] = {"accuracy": _accuracy(probs.cpu(), test[1])}
        full = build_full_model(model_config, full_state, device).eval()
        metrics["test"], _ = evaluate_logits(full, x_test, test[1])
        scale = unified_branch_scale(plan)
        metrics["test_branch_scaled"], _ = evaluate_logits(lambda x: _logits(full, x, scale), x_test, test[1])
        del full
    del full_state
    steady = sorted(times[3:] or times)
    return SubnetDPResult(
        rank=rank, num_workers=world, overlap=overlap, masking=config.masking, steps=steps,
        epochs=steps * config.batch_size * world / len(train[0]), plan_fingerprint=plan.fingerprint(),
        worker_parameters=sum(p.numel() for p in subnet.parameters()), full_parameters=full_parameters,
        state_bytes=held, full_state_bytes=full_bytes, payload_bytes_per_step=payload, wire_bytes_per_step=wire,
        seconds_per_step=steady[len(steady) // 2] if steady else 0.0, final_loss=float(tail) / world,
        max_owner_discrepancy=worst, memory=memory, **metrics)


def train_ddp_baseline(model_config: SubnetResNetConfig, train: tuple[torch.Tensor, torch.Tensor],
                       test: tuple[torch.Tensor, torch.Tensor] | None, config: SubnetDPConfig, *,
                       device: str | torch.device = "cpu", probe: Any = None) -> SubnetDPResult:
    """The same loop with the full model wrapped in torch's DistributedDataParallel (the reference DP
    for the benchmark: its memory, bytes and time next to ours at P = N)."""
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    model_config = model_config_for(model_config, config.masking, world, world)
    memory: dict[str, Any] = {}
    if probe is not None:
        from edgetrain.probes.base import settle_memory

        settle_memory()
        probe.reset_peak()
        memory["baseline_bytes"] = probe.current_bytes()
    model = build_subnet_resnet(model_config, device=device)
    ddp = DistributedDataParallel(model, device_ids=None)
    steps = total_steps(config, world, world, len(train[0]))
    optimizer, scheduler = make_optimizer(model.parameters(), config, steps)
    stream = ArrayStream(train[0], train[1], batch_size=config.batch_size * world, shuffle=True, seed=config.data_seed)
    cuda = torch.device(device).type == "cuda"
    times, losses = [], []
    for step in range(steps):
        batch = stream.batch(step)
        x, y = _shard(batch.inputs, batch.targets, rank, config.batch_size)
        x, y = x.to(device), y.to(device)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    held = state_bytes(model, optimizer)
    if probe is not None:
        memory.update(probe=probe.name, peak_bytes=probe.peak_bytes())
        memory["peak_above_baseline_bytes"] = max(0, memory["peak_bytes"] - memory["baseline_bytes"])
    parameters = sum(p.numel() for p in model.parameters())
    payload = parameters * next(model.parameters()).element_size()  # DDP all-reduces every gradient
    metrics: dict[str, dict[str, float]] = {}
    if test is not None:
        metrics["test"], _ = evaluate_logits(model.eval(), test[0].to(device), test[1])
    steady = sorted(times[3:] or times)
    tail = torch.tensor(sum(losses[-10:]) / max(1, len(losses[-10:])), device=device)
    dist.all_reduce(tail)
    return SubnetDPResult(
        rank=rank, num_workers=world, overlap=world, masking="ddp", steps=steps,
        epochs=steps * config.batch_size * world / len(train[0]), plan_fingerprint="", worker_parameters=parameters,
        full_parameters=parameters, state_bytes=held, full_state_bytes=dict(held), payload_bytes_per_step=payload,
        wire_bytes_per_step=int(2 * (world - 1) / world * payload) if world > 1 else 0,
        seconds_per_step=steady[len(steady) // 2] if steady else 0.0, final_loss=float(tail) / world,
        memory=memory, **metrics)


def build_full_model(model_config: SubnetResNetConfig, state: dict[str, torch.Tensor],
                     device: str | torch.device = "cpu") -> ResNet:
    with torch.device("meta"):
        model = ResNet(model_config)
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(state[name])
    return model


# -- single process ------------------------------------------------------------------------------

def train_simulated(model_config: SubnetResNetConfig, train: tuple[torch.Tensor, torch.Tensor],
                    test: tuple[torch.Tensor, torch.Tensor] | None, config: SubnetDPConfig, num_workers: int, *,
                    on_step: Callable[[int, nn.Module, Any], None] | None = None) -> dict[str, Any]:
    """All N workers in one process (the `subnet_dp` method on the full model): the same updates as
    `train_subnet_dp` with the same config and N, without the memory saving. For diagnostics and tests."""
    from edgetrain.distributed.subnet.method import SubnetDPSimulation

    overlap = config.overlap_for(num_workers)
    model_config = model_config_for(model_config, config.masking, num_workers, overlap)
    model = build_subnet_resnet(model_config)
    method = SubnetDPSimulation(model, num_workers=num_workers, overlap=overlap, masking=config.masking,
                                mask_seed=config.mask_seed, load_slack=config.load_slack)
    steps = total_steps(config, num_workers, overlap, len(train[0]))
    optimizer, scheduler = make_optimizer(model.parameters(), config, steps)
    stream = ArrayStream(train[0], train[1], batch_size=config.batch_size * num_workers, shuffle=True,
                         seed=config.data_seed)
    losses = []
    for step in range(steps):
        batch = stream.batch(step)
        loss = method.step(batch, optimizer)
        scheduler.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, model, method)
    result = {"steps": steps, "epochs": steps * config.batch_size * num_workers / len(train[0]),
              "final_loss": sum(losses[-10:]) / max(1, len(losses[-10:])), "model": model, "plan": method.plan,
              "losses": losses}  # per step: the mean of the N workers' losses
    if test is not None:
        result.update(evaluate_simulated(model, method.plan, test))
    return result


@torch.no_grad()
def evaluate_simulated(model: nn.Module, plan: SubnetPlan, test: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    """The evaluations of SubnetDPResult for a full model and plan in one process; test_subnetwork is
    the mean over the N workers' subnetworks (masked forwards)."""
    from edgetrain.distributed.subnet.subnetwork import masked_forward

    model.eval()
    out: dict[str, Any] = {}
    out["test"], _ = evaluate_logits(model, *test)
    scale = unified_branch_scale(plan)
    out["test_branch_scaled"], _ = evaluate_logits(lambda x: _logits(model, x, scale), *test)
    accuracies, total = [], None
    for worker in range(plan.num_workers):
        metrics, probs = evaluate_logits(lambda x: masked_forward(model, plan, worker, x), *test)
        accuracies.append(metrics["accuracy"])
        total = probs if total is None else total + probs
    out["test_subnetwork"] = {"accuracy": sum(accuracies) / len(accuracies), "per_worker": accuracies}
    out["test_ensemble"] = {"accuracy": _accuracy(total, test[1])}
    model.train()
    return out


class _StochasticDepth(nn.Module):
    """The full ResNet with per-step block dropping (Huang et al. 2016): during training each residual
    branch is kept with probability `survival` (one draw per step), a dropped one is relu(shortcut(h));
    at evaluation every branch runs, scaled by `survival` if `scale_at_test` (Huang et al.'s rule)."""

    def __init__(self, model: ResNet, survival: float, seed: int) -> None:
        super().__init__()
        self.model, self.survival = model, survival
        self.generator = torch.Generator().manual_seed(seed)
        self.scale_at_test = True
        self.config, self.task = model.config, "classify"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model.embed(x)
        for block in self.model.blocks:
            if self.training:
                keep = bool(torch.rand((), generator=self.generator) < self.survival)
                h = masked_block(block, h, None) if keep else dropped_block(block, h)
            else:
                h = masked_block(block, h, None, self.survival if self.scale_at_test else 1.0)
        return self.model.head(h)


def train_stochastic_depth(model_config: SubnetResNetConfig, train: tuple[torch.Tensor, torch.Tensor],
                           test: tuple[torch.Tensor, torch.Tensor] | None, config: SubnetDPConfig,
                           num_workers: int) -> dict[str, Any]:
    """One worker, the full model, the same global batch (N * batch_size), schedule and epoch count as
    the subnetwork run with `config` and N; every branch dropped with probability 1 - P/N each step.
    Reports test accuracy both with Huang et al.'s test-time scaling and without it (as subnet DP evaluates)."""
    overlap = config.overlap_for(num_workers)
    survival = overlap / num_workers
    model = build_subnet_resnet(replace(model_config, masked_fan_out_fraction=1.0))
    wrapped = _StochasticDepth(model, survival, seed=config.mask_seed)
    steps = total_steps(config, num_workers, overlap, len(train[0]))
    optimizer, scheduler = make_optimizer(model.parameters(), config, steps)
    stream = ArrayStream(train[0], train[1], batch_size=config.batch_size * num_workers, shuffle=True,
                         seed=config.data_seed)
    wrapped.train()
    losses = []
    for step in range(steps):
        batch = stream.batch(step)
        loss = F.cross_entropy(wrapped(batch.inputs), batch.targets)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    result: dict[str, Any] = {"steps": steps, "final_loss": sum(losses[-10:]) / max(1, len(losses[-10:])),
                              "model": model, "survival": survival}
    if test is not None:
        wrapped.scale_at_test = True
        result["test"] = evaluate(wrapped, test[0], test[1])
        wrapped.scale_at_test = False
        result["test_unscaled"] = evaluate(wrapped, test[0], test[1])
    return result


def plan_for(model_config: SubnetResNetConfig, config: SubnetDPConfig, num_workers: int) -> SubnetPlan:
    overlap = config.overlap_for(num_workers)
    return assign_masks(layout_of(model_config), config.masking, num_workers, overlap, config.mask_seed,
                        load_slack=config.load_slack)
