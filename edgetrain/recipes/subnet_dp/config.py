"""The settings of a subnetwork-DP run (§4) and what follows from them: the learning-rate schedule,
the optimizer, the number of steps, the model's init and the mask plan every rank builds alike."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable

import torch

from edgetrain.recipes.subnet_dp.averaging import ENGINES
from edgetrain.methods.subnet_dp.assign import assign_masks
from edgetrain.methods.subnet_dp.layout import MASKINGS, ResNetLayout
from edgetrain.methods.subnet_dp.plan import SubnetPlan
from edgetrain.models.resnet import ResNet
from edgetrain.models.resnet_subnet import SubnetResNetConfig
from edgetrain.registry import EdgetrainError
from edgetrain.training.schedules import warmup_cosine_factor

SCHEDULERS = ("cosine", "multistep")


@dataclass
class SubnetDPConfig:
    masking: str = "block"            # "block" or "neuron"
    overlap: int | None = None        # P; None means P = N (data parallelism)
    mask_seed: int = 0
    load_slack: float | None = None   # block masking's memory cap (assign_masks); None: the default 0.2
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
    if config.scheduler == "cosine":
        return warmup_cosine_factor(step, total, warmup, config.lr_min / config.lr)
    if step < warmup:
        return (step + 1) / warmup
    passed = sum(step >= round(m * total) for m in config.milestones)
    return config.gamma ** passed


def make_optimizer(params: Iterable[torch.nn.Parameter], config: SubnetDPConfig, total_steps: int
                   ) -> tuple[torch.optim.SGD, torch.optim.lr_scheduler.LambdaLR]:
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


def plan_for(model_config: SubnetResNetConfig, config: SubnetDPConfig, num_workers: int) -> SubnetPlan:
    overlap = config.overlap_for(num_workers)
    return assign_masks(layout_of(model_config), config.masking, num_workers, overlap, config.mask_seed,
                        load_slack=config.load_slack)
