"""ResNet-18 (He et al. 2016) with BasicBlocks; stem and normalisation chosen by the config.

Block view: embed = the stem, blocks = the BasicBlocks in order (8 for ResNet-18), head = global
average pool + flatten + Linear.

Stems: "cifar" is a 3x3 stride-1 conv without max-pool (the common CIFAR adaptation; 32x32 inputs
reach the last stage at 4x4), "imagenet" the original 7x7 stride-2 conv + 3x3 stride-2 max-pool.
Norms: "batch" (BatchNorm2d) or "group" (GroupNorm with `num_groups` groups). GroupNorm keeps no
running statistics and normalises each sample on its own, so a model whose channels are split
across devices (subnetwork data parallelism uses 2 groups) or trained on tiny batches still works.
Parameter counts match the references: 11,173,962 for the CIFAR stem with 10 classes, 11,689,512
(torchvision resnet18) for the ImageNet stem with 1000.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from edgetrain.models.llama import ConfigError
from edgetrain.models.mlp import check_choice, check_positive_ints, seeded_build
from edgetrain.models.zoo import MODEL_PRESETS

STEMS = ("cifar", "imagenet")
NORMS = ("batch", "group")


@dataclass
class ResNetConfig:
    num_classes: int = 10
    in_channels: int = 3
    stem: str = "cifar"
    norm: str = "batch"
    num_groups: int = 2  # GroupNorm only; must divide every stage width
    blocks_per_stage: tuple[int, ...] = (2, 2, 2, 2)  # ResNet-18; (3, 4, 6, 3) gives ResNet-34
    width: int = 64  # channels of the first stage, doubled at every later one
    seed: int | None = 0  # weights are a function of the config; None draws from the global RNG

    def __post_init__(self) -> None:
        self.blocks_per_stage = tuple(self.blocks_per_stage)
        check_positive_ints(self, "num_classes", "in_channels", "num_groups", "blocks_per_stage", "width")
        check_choice(self, "stem", STEMS)
        check_choice(self, "norm", NORMS)
        if self.norm == "group" and any(w % self.num_groups for w in self.stage_widths):
            raise ConfigError(f"ResNetConfig.num_groups = {self.num_groups}: must divide every stage width "
                              f"{self.stage_widths}")

    @property
    def stage_widths(self) -> tuple[int, ...]:
        return tuple(self.width * 2**i for i in range(len(self.blocks_per_stage)))


def make_norm(config: ResNetConfig, channels: int) -> nn.Module:
    if config.norm == "group":
        return nn.GroupNorm(config.num_groups, channels)
    return nn.BatchNorm2d(channels)


class Stem(nn.Module):
    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        width = config.width
        if config.stem == "cifar":
            self.conv = nn.Conv2d(config.in_channels, width, 3, stride=1, padding=1, bias=False)
            self.pool: nn.Module = nn.Identity()
        else:
            self.conv = nn.Conv2d(config.in_channels, width, 7, stride=2, padding=3, bias=False)
            self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        self.norm = make_norm(config, width)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.act(self.norm(self.conv(x))))


class BasicBlock(nn.Module):
    """Two 3x3 convs with a residual; a strided 1x1 conv + norm projects the shortcut when the shape changes."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, config: ResNetConfig) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.norm1 = make_norm(config, out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.norm2 = make_norm(config, out_channels)
        self.act = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                                          make_norm(config, out_channels))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.act(self.norm1(self.conv1(h)))
        out = self.norm2(self.conv2(out))
        return self.act(out + self.shortcut(h))


class ClassifierHead(nn.Module):
    def __init__(self, in_features: int, num_classes: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(start_dim=1)
        self.fc = nn.Linear(in_features, num_classes)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc(self.flatten(self.pool(h)))


class ResNet(nn.Module):
    task = "classify"

    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = Stem(config)
        blocks = []
        in_channels = config.width
        for stage, (count, width) in enumerate(zip(config.blocks_per_stage, config.stage_widths)):
            for index in range(count):
                # Every stage after the first halves the map in its first block.
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(BasicBlock(in_channels, width, stride, config))
                in_channels = width
        self.blocks = nn.ModuleList(blocks)
        self.head = ClassifierHead(in_channels, config.num_classes)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        # torchvision's init: He-normal convs (fan_out, for the ReLUs), unit norms; Linear keeps the default.
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build_resnet(config: ResNetConfig) -> ResNet:
    return seeded_build(config.seed, lambda: ResNet(config))


def resnet18_cifar_config(**overrides: object) -> ResNetConfig:
    """ResNet-18 for 3x32x32 CIFAR-10 images; overrides (e.g. norm="group") go to ResNetConfig."""
    return ResNetConfig(**{"num_classes": 10, "stem": "cifar", **overrides})  # type: ignore[arg-type]


def resnet18_imagenet_config(**overrides: object) -> ResNetConfig:
    """ResNet-18 for 3x224x224 ImageNet images (any size >= 32 runs: the head pools globally)."""
    return ResNetConfig(**{"num_classes": 1000, "stem": "imagenet", **overrides})  # type: ignore[arg-type]


@MODEL_PRESETS.register("resnet18-cifar")
def resnet18_cifar() -> ResNet:
    return build_resnet(resnet18_cifar_config())


@MODEL_PRESETS.register("resnet18-imagenet")
def resnet18_imagenet() -> ResNet:
    return build_resnet(resnet18_imagenet_config())


@MODEL_PRESETS.register("resnet18-cifar-gn")
def resnet18_cifar_gn() -> ResNet:
    """GroupNorm with 2 groups, as subnetwork data parallelism trains it (its masks keep whole groups)."""
    return build_resnet(resnet18_cifar_config(norm="group", num_groups=2))
