"""The training runs of subnetwork data parallelism (§3-4), all through one loop (`run_loop`).

    config = SubnetDPConfig(masking="block", overlap=2, epochs=30)     # N = the world size
    result = train_subnet_dp(model_config, (x_train, y_train), (x_test, y_test), config)

`train_subnet_dp` runs on every rank of a process group: each step the global batch of N * batch_size
examples is cut into N consecutive shards, one per rank, and gradients are averaged over each
parameter's owners; P = N is data parallelism (tested equal to torch DDP). Settings, schedule and
FLOP matching: config.py. The other runs share the loop: `train_ddp_baseline` (the full model under
torch DDP), `train_simulated` (all N workers in one process, through the `subnet_dp` method, for
diagnostics and tests) and `train_stochastic_depth` (the single-worker baseline reviewers asked for:
each step drops every residual branch with probability 1 - P/N).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from edgetrain.data.arrays import ArrayStream
from edgetrain.data.batch import Batch
from edgetrain.recipes.subnet_dp.averaging import MaskedAverager, gather_full_state
from edgetrain.recipes.subnet_dp.config import (SubnetDPConfig, make_optimizer, model_config_for, plan_for,
                                                 total_steps)
from edgetrain.recipes.subnet_dp.evaluation import (accuracy, branch_scaled_logits, build_full_model, evaluate,
                                                     evaluate_logits, evaluate_simulated, unified_branch_scale)
from edgetrain.methods.subnet_dp.method import SubnetDPSimulation
from edgetrain.methods.subnet_dp.subnetwork import dropped_block, masked_block, materialise_subnetwork, state_bytes
from edgetrain.models.resnet import ResNet
from edgetrain.models.resnet_subnet import SubnetResNetConfig, build_subnet_resnet
from edgetrain.registry import EdgetrainError

__all__ = ["Loop", "SubnetDPConfig", "SubnetDPResult", "run_loop", "train_ddp_baseline", "train_simulated",
           "train_stochastic_depth", "train_subnet_dp"]

Data = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Loop:
    """What `run_loop` leaves behind: the step count, the optimizer, and each step's loss and seconds."""
    steps: int
    optimizer: torch.optim.Optimizer
    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def tail_loss(self) -> float:
        """Mean loss of the last 10 steps."""
        return sum(self.losses[-10:]) / max(1, len(self.losses[-10:]))

    def median_seconds(self) -> float:
        """Median seconds per step after the first 3 (warm-up)."""
        steady = sorted(self.seconds[3:] or self.seconds)
        return steady[len(steady) // 2] if steady else 0.0


def run_loop(params: Any, train: Data, config: SubnetDPConfig, num_workers: int, overlap: int,
             update: Callable[[Any, torch.optim.Optimizer], torch.Tensor], *,
             prepare: Callable[[Batch], Any] | None = None, after: Callable[[int, torch.Tensor], None] | None = None,
             device: str | torch.device | None = None) -> Loop:
    """The one training loop of every run here. Each step takes global batch `step` of the seeded
    stream (N * batch_size examples), `prepare`s it (a rank's shard on its device; outside the timed
    window), runs `update(inputs, optimizer)` (forward, backward, averaging, the optimizer step; returns
    the loss) and the lr schedule's step, then calls `after(step, loss)`. The step count, optimizer and
    schedule follow from `config` (config.py)."""
    steps = total_steps(config, num_workers, overlap, len(train[0]))
    optimizer, scheduler = make_optimizer(params, config, steps)
    stream = ArrayStream(train[0], train[1], batch_size=config.batch_size * num_workers, shuffle=True,
                         seed=config.data_seed)
    cuda = device is not None and torch.device(device).type == "cuda"
    loop = Loop(steps, optimizer)
    for step in range(steps):
        batch = stream.batch(step)
        inputs = prepare(batch) if prepare is not None else batch
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = update(inputs, optimizer)
        scheduler.step()
        if cuda:
            torch.cuda.synchronize()
        loop.seconds.append(time.perf_counter() - start)
        loop.losses.append(float(loss.detach()))
        if after is not None:
            after(step, loss)
    return loop


def _backward_and_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer,
                       average: Callable[[], Any] | None = None) -> torch.Tensor:
    loss.backward()
    if average is not None:
        average()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


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


# -- one rank of a process group -------------------------------------------------------------------

def _rank_shard(rank: int, per_worker: int, device: str | torch.device) -> Callable[[Batch], Data]:
    def shard(batch: Batch) -> Data:
        rows = slice(rank * per_worker, (rank + 1) * per_worker)
        return batch.inputs[rows].to(device), batch.targets[rows].to(device)
    return shard


def _measure_from(probe: Any) -> dict[str, Any]:
    """Settle memory and reset `probe`'s peak; the baseline the run's peak is measured above."""
    memory: dict[str, Any] = {}
    if probe is not None:
        from edgetrain.probes.base import settle_memory

        settle_memory()
        probe.reset_peak()
        memory["baseline_bytes"] = probe.current_bytes()
    return memory


def _measure_to(probe: Any, memory: dict[str, Any]) -> None:
    if probe is not None:
        memory.update(probe=probe.name, peak_bytes=probe.peak_bytes())
        memory["peak_above_baseline_bytes"] = max(0, memory["peak_bytes"] - memory["baseline_bytes"])


def _rank_mean(value: float, device: str | torch.device) -> float:
    total = torch.tensor(value, device=device)
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def train_subnet_dp(model_config: SubnetResNetConfig, train: Data, test: Data | None, config: SubnetDPConfig, *,
                    device: str | torch.device = "cpu", probe: Any = None,
                    on_step: Callable[[int, nn.Module, float], None] | None = None) -> SubnetDPResult:
    """Train on this rank's subnetwork inside an initialised process group (world size N).

    `probe`, a memory probe (edgetrain.probes), is reset before the subnetwork is built and read after
    the last step, so `result.memory` holds this rank's measured training peak. The unified full model
    is assembled afterwards (one full copy per rank, outside the measured window) to evaluate `test`."""
    if not dist.is_initialized():
        raise EdgetrainError("train_subnet_dp runs inside a process group: launch with torchrun "
                             "(python -m edgetrain.recipes.subnet_dp.run) or call init_process_group first")
    rank, world = dist.get_rank(), dist.get_world_size()
    overlap = config.overlap_for(world)
    model_config = model_config_for(model_config, config.masking, world, overlap)
    plan = plan_for(model_config, config, world)
    fingerprints: list[Any] = [None] * world
    dist.all_gather_object(fingerprints, plan.fingerprint())
    if len(set(fingerprints)) != 1:
        raise EdgetrainError(f"ranks built different mask plans {fingerprints}: same seed, model and N on every rank?")

    memory = _measure_from(probe)
    subnet = materialise_subnetwork(model_config, plan, rank, device=device)
    averager = MaskedAverager(subnet, engine=config.engine)
    traffic = {"payload_bytes": 0, "wire_bytes": 0}  # of the last step
    worst: float | None = None

    def average() -> None:
        traffic.update(averager.average())

    def after(step: int, loss: torch.Tensor) -> None:
        nonlocal worst
        if config.check_sync_every and (step + 1) % config.check_sync_every == 0:
            gap = averager.owner_discrepancy()
            worst = gap if worst is None else max(worst, gap)
        if on_step is not None:
            on_step(step, subnet, float(loss.detach()))

    loop = run_loop(subnet.parameters(), train, config, world, overlap,
                    lambda xy, optimizer: _backward_and_step(F.cross_entropy(subnet(xy[0]), xy[1]), optimizer, average),
                    prepare=_rank_shard(rank, config.batch_size, device), after=after, device=device)
    held = state_bytes(subnet, loop.optimizer)
    _measure_to(probe, memory)
    final_loss = _rank_mean(loop.tail_loss(), device)
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
        metrics["test_ensemble"] = {"accuracy": accuracy(probs.cpu(), test[1])}
        full = build_full_model(model_config, full_state, device).eval()
        metrics["test"], _ = evaluate_logits(full, x_test, test[1])
        scale = unified_branch_scale(plan)
        metrics["test_branch_scaled"], _ = evaluate_logits(lambda x: branch_scaled_logits(full, x, scale), x_test,
                                                           test[1])
        del full
    del full_state
    return SubnetDPResult(
        rank=rank, num_workers=world, overlap=overlap, masking=config.masking, steps=loop.steps,
        epochs=loop.steps * config.batch_size * world / len(train[0]), plan_fingerprint=plan.fingerprint(),
        worker_parameters=sum(p.numel() for p in subnet.parameters()), full_parameters=full_parameters,
        state_bytes=held, full_state_bytes=full_bytes, payload_bytes_per_step=traffic["payload_bytes"],
        wire_bytes_per_step=traffic["wire_bytes"], seconds_per_step=loop.median_seconds(), final_loss=final_loss,
        max_owner_discrepancy=worst, memory=memory, **metrics)


def train_ddp_baseline(model_config: SubnetResNetConfig, train: Data, test: Data | None, config: SubnetDPConfig, *,
                       device: str | torch.device = "cpu", probe: Any = None) -> SubnetDPResult:
    """The same loop with the full model wrapped in torch's DistributedDataParallel (the reference DP
    for the benchmark: its memory, bytes and time next to ours at P = N)."""
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    model_config = model_config_for(model_config, config.masking, world, world)
    memory = _measure_from(probe)
    model = build_subnet_resnet(model_config, device=device)
    ddp = DistributedDataParallel(model, device_ids=None)
    loop = run_loop(model.parameters(), train, config, world, world,
                    lambda xy, optimizer: _backward_and_step(F.cross_entropy(ddp(xy[0]), xy[1]), optimizer),
                    prepare=_rank_shard(rank, config.batch_size, device), device=device)
    held = state_bytes(model, loop.optimizer)
    _measure_to(probe, memory)
    parameters = sum(p.numel() for p in model.parameters())
    payload = parameters * next(model.parameters()).element_size()  # DDP all-reduces every gradient
    metrics: dict[str, dict[str, float]] = {}
    if test is not None:
        metrics["test"], _ = evaluate_logits(model.eval(), test[0].to(device), test[1])
    return SubnetDPResult(
        rank=rank, num_workers=world, overlap=world, masking="ddp", steps=loop.steps,
        epochs=loop.steps * config.batch_size * world / len(train[0]), plan_fingerprint="",
        worker_parameters=parameters, full_parameters=parameters, state_bytes=held, full_state_bytes=dict(held),
        payload_bytes_per_step=payload, wire_bytes_per_step=int(2 * (world - 1) / world * payload) if world > 1 else 0,
        seconds_per_step=loop.median_seconds(), final_loss=_rank_mean(loop.tail_loss(), device), memory=memory,
        **metrics)


# -- single process ------------------------------------------------------------------------------

def train_simulated(model_config: SubnetResNetConfig, train: Data, test: Data | None, config: SubnetDPConfig,
                    num_workers: int, *, on_step: Callable[[int, nn.Module, Any], None] | None = None
                    ) -> dict[str, Any]:
    """All N workers in one process (the `subnet_dp` method on the full model): the same updates as
    `train_subnet_dp` with the same config and N, without the memory saving. For diagnostics and tests."""
    overlap = config.overlap_for(num_workers)
    model_config = model_config_for(model_config, config.masking, num_workers, overlap)
    model = build_subnet_resnet(model_config)
    method = SubnetDPSimulation(model, num_workers=num_workers, overlap=overlap, masking=config.masking,
                                mask_seed=config.mask_seed, load_slack=config.load_slack)
    loop = run_loop(model.parameters(), train, config, num_workers, overlap, method.step,
                    after=None if on_step is None else lambda step, loss: on_step(step, model, method))
    result = {"steps": loop.steps, "epochs": loop.steps * config.batch_size * num_workers / len(train[0]),
              "final_loss": loop.tail_loss(), "model": model, "plan": method.plan,
              "losses": loop.losses}  # per step: the mean of the N workers' losses
    if test is not None:
        result.update(evaluate_simulated(model, method.plan, test))
    return result


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


def train_stochastic_depth(model_config: SubnetResNetConfig, train: Data, test: Data | None,
                           config: SubnetDPConfig, num_workers: int) -> dict[str, Any]:
    """One worker, the full model, the same global batch (N * batch_size), schedule and epoch count as
    the subnetwork run with `config` and N; every branch dropped with probability 1 - P/N each step.
    Reports test accuracy both with Huang et al.'s test-time scaling and without it (as subnet DP evaluates)."""
    overlap = config.overlap_for(num_workers)
    survival = overlap / num_workers
    model = build_subnet_resnet(replace(model_config, masked_fan_out_fraction=1.0))
    wrapped = _StochasticDepth(model, survival, seed=config.mask_seed)
    wrapped.train()
    loop = run_loop(model.parameters(), train, config, num_workers, overlap,
                    lambda batch, optimizer: _backward_and_step(
                        F.cross_entropy(wrapped(batch.inputs), batch.targets), optimizer))
    result: dict[str, Any] = {"steps": loop.steps, "final_loss": loop.tail_loss(), "model": model,
                              "survival": survival}
    if test is not None:
        wrapped.scale_at_test = True
        result["test"] = evaluate(wrapped, test[0], test[1])
        wrapped.scale_at_test = False
        result["test_unscaled"] = evaluate(wrapped, test[0], test[1])
    return result
