"""The ResNet of subnetwork data parallelism (Singh et al. 2025, §4): the zoo's ResNet (BasicBlocks,
edgetrain.models.resnet) with GroupNorm of 2 groups and a Kaiming init whose fan-out counts only the
output units a worker keeps.

Init. Every parameter's initial value is a function of (config.seed, parameter name) alone: a
generator seeded from both draws it. A worker of a subnetwork-data-parallel run therefore builds the
slices it owns without ever holding the full model (`initial_parameter`, one full tensor at a time),
and every owner of a slice starts from the same values as the full model `build_subnet_resnet` makes.
Convs are He-normal with mode fan_out, std = sqrt(2 / fan_out); for the first conv of each residual
branch (`blocks.k.conv1`, whose output channels neuron masking splits across workers) the fan-out is
out_channels * k * k * `masked_fan_out_fraction`, the active output units of one worker (P/N for
neuron masking; 1 for block masking and for plain DP, where no output unit of a kept layer is masked).
Norm weights are 1, biases 0; the classifier is uniform(+-1/sqrt(fan_in)) like torch's Linear default.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
from torch import nn

from edgetrain.models.llama import ConfigError
from edgetrain.models.resnet import ResNet, ResNetConfig
from edgetrain.models.zoo import MODEL_PRESETS


@dataclass
class SubnetResNetConfig(ResNetConfig):
    norm: str = "group"
    num_groups: int = 2
    # Fraction of each residual branch's hidden channels one worker holds (P/N under neuron masking).
    masked_fan_out_fraction: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < float(self.masked_fan_out_fraction) <= 1.0:
            raise ConfigError(f"SubnetResNetConfig.masked_fan_out_fraction = {self.masked_fan_out_fraction!r}: "
                              "must be in (0, 1]")
        if self.seed is None:
            raise ConfigError("SubnetResNetConfig.seed must be an int: every worker draws its slices from it")


def _generator(seed: int, name: str) -> torch.Generator:
    # crc32 is stable across processes and Python versions (hash() of a str is salted per process).
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def initial_parameter(config: SubnetResNetConfig, name: str, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """The initial value (float32, CPU) of the full model's parameter `name` of shape `shape`."""
    shape = tuple(shape)
    generator = _generator(config.seed, name)  # type: ignore[arg-type]
    leaf = name.rsplit(".", 1)[-1]
    owner = name.rsplit(".", 2)[-2] if "." in name else ""
    if len(shape) == 4:  # conv weight [out, in, k, k]
        fan_out = shape[0] * shape[2] * shape[3]
        if owner == "conv1" and name.startswith("blocks."):
            fan_out = fan_out * float(config.masked_fan_out_fraction)
        std = math.sqrt(2.0 / fan_out)
        return torch.randn(shape, generator=generator) * std
    if name.startswith("head.fc."):
        fan_in = config.stage_widths[-1]
        bound = 1.0 / math.sqrt(fan_in)
        return (torch.rand(shape, generator=generator) * 2 - 1) * bound
    if len(shape) == 1:  # GroupNorm affine (embed.norm, blocks.k.norm1/2, blocks.k.shortcut.1)
        return torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
    raise ConfigError(f"no initial value defined for parameter {name!r} of shape {shape}")


def build_subnet_resnet(config: SubnetResNetConfig, device: str | torch.device = "cpu") -> ResNet:
    """The full model with the init described above (what P = N, evaluation and the diagnostics use)."""
    with torch.device("meta"):
        model = ResNet(config)
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(initial_parameter(config, name, param.shape))
    return model


def digits_subnet_config(**overrides: object) -> SubnetResNetConfig:
    """A small ResNet for scikit-learn's 8x8 digits: 1 input channel, stages of 8/16/32/64 channels,
    two BasicBlocks each (the ResNet-18 layout at 1/8 width)."""
    return SubnetResNetConfig(**{"num_classes": 10, "in_channels": 1, "stem": "cifar", "width": 8,
                                 "blocks_per_stage": (2, 2, 2, 2), **overrides})  # type: ignore[arg-type]


@MODEL_PRESETS.register("resnet18-cifar-subnet")
def resnet18_cifar_subnet() -> nn.Module:
    """ResNet-18 (CIFAR stem) as subnetwork data parallelism trains it: GroupNorm(2), per-name init."""
    return build_subnet_resnet(SubnetResNetConfig(num_classes=10, stem="cifar"))


@MODEL_PRESETS.register("resnet-digits-subnet")
def resnet_digits_subnet() -> nn.Module:
    return build_subnet_resnet(digits_subnet_config())
