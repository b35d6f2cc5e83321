"""MobileNetV3-Small (Howard et al. 2019, Table 2), laid out as torchvision's mobilenet_v3_small.

Block view: embed = the stem (3x3 stride-2 conv, BN, hard-swish), blocks = the 11 inverted-residual
bottlenecks (1x1 expand, kxk depthwise, optional squeeze-excite, 1x1 linear projection, residual
when the shape is kept), head = 1x1 conv to 576 + hard-swish, global pool, Linear 1024 +
hard-swish, dropout, Linear to the classes.
With 1000 classes it has torchvision's 2,542,856 parameters.

CIFAR variant (`mobilenetv3-small-cifar`): the stem runs at stride 1 instead of 2, so a 32x32 image
goes through the bottlenecks' four stride-2 stages to a 2x2 map instead of 1x1 (a 1x1 map makes the
last 5x5 depthwise convs see only padding around one pixel). Only the stem changes, so the weights
keep the ImageNet layout. Its dropout is 0: the forward-only methods (MeZO, forward gradients)
compare forwards of one batch, and a fresh dropout mask per forward adds noise to that comparison.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from edgetrain.models.llama import ConfigError
from edgetrain.models.mlp import check_positive_ints, seeded_build
from edgetrain.models.zoo import MODEL_PRESETS

# BatchNorm settings of the reference implementation (TensorFlow's defaults for MobileNet).
BN_EPS = 1e-3
BN_MOMENTUM = 0.01


@dataclass(frozen=True)
class Bottleneck:
    kernel: int
    expanded: int
    out: int
    squeeze_excite: bool
    hard_swish: bool  # False: ReLU
    stride: int


# The paper's Table 2 (MobileNetV3-Small), input 16 channels from the stem.
SMALL_BOTTLENECKS = (
    Bottleneck(3, 16, 16, True, False, 2),
    Bottleneck(3, 72, 24, False, False, 2),
    Bottleneck(3, 88, 24, False, False, 1),
    Bottleneck(5, 96, 40, True, True, 2),
    Bottleneck(5, 240, 40, True, True, 1),
    Bottleneck(5, 240, 40, True, True, 1),
    Bottleneck(5, 120, 48, True, True, 1),
    Bottleneck(5, 144, 48, True, True, 1),
    Bottleneck(5, 288, 96, True, True, 2),
    Bottleneck(5, 576, 96, True, True, 1),
    Bottleneck(5, 576, 96, True, True, 1),
)
STEM_CHANNELS = 16
LAST_CONV_CHANNELS = 576
LAST_CHANNEL = 1024


@dataclass
class MobileNetV3Config:
    num_classes: int = 1000
    in_channels: int = 3
    stem_stride: int = 2  # 1 for 32x32 inputs (see the module docstring)
    dropout: float = 0.2
    seed: int | None = 0  # weights are a function of the config; None draws from the global RNG

    def __post_init__(self) -> None:
        check_positive_ints(self, "num_classes", "in_channels", "stem_stride")
        if not (isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1):
            raise ConfigError(f"MobileNetV3Config.dropout = {self.dropout!r}: must be in [0, 1)")


def make_divisible(value: float, divisor: int = 8) -> int:
    """Round to a multiple of `divisor` without going more than 10% below (the reference's channel rule)."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


def conv_norm_act(in_channels: int, out_channels: int, kernel: int, stride: int = 1, groups: int = 1,
                  activation: type[nn.Module] | None = None) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(in_channels, out_channels, kernel, stride=stride, padding=(kernel - 1) // 2, groups=groups,
                  bias=False),
        nn.BatchNorm2d(out_channels, eps=BN_EPS, momentum=BN_MOMENTUM),
    ]
    if activation is not None:
        layers.append(activation())
    return nn.Sequential(*layers)


class SqueezeExcite(nn.Module):
    """Channel gates from globally pooled features: pool -> 1x1 reduce -> ReLU -> 1x1 expand -> hard-sigmoid."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        squeezed = make_divisible(channels / 4)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.reduce = nn.Conv2d(channels, squeezed, 1)
        self.act = nn.ReLU()
        self.expand = nn.Conv2d(squeezed, channels, 1)
        self.gate = nn.Hardsigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(self.expand(self.act(self.reduce(self.pool(x)))))


class InvertedResidual(nn.Module):
    def __init__(self, in_channels: int, spec: Bottleneck) -> None:
        super().__init__()
        activation = nn.Hardswish if spec.hard_swish else nn.ReLU
        # No expansion conv when the table asks for no expansion (the first bottleneck).
        self.expand = (conv_norm_act(in_channels, spec.expanded, 1, activation=activation)
                       if spec.expanded != in_channels else nn.Identity())
        self.depthwise = conv_norm_act(spec.expanded, spec.expanded, spec.kernel, stride=spec.stride,
                                       groups=spec.expanded, activation=activation)
        self.squeeze_excite = SqueezeExcite(spec.expanded) if spec.squeeze_excite else nn.Identity()
        self.project = conv_norm_act(spec.expanded, spec.out, 1)  # linear bottleneck: no activation
        self.residual = spec.stride == 1 and in_channels == spec.out

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.project(self.squeeze_excite(self.depthwise(self.expand(h))))
        return h + out if self.residual else out


class MobileNetHead(nn.Module):
    def __init__(self, in_channels: int, num_classes: int, dropout: float) -> None:
        super().__init__()
        self.conv = conv_norm_act(in_channels, LAST_CONV_CHANNELS, 1, activation=nn.Hardswish)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(start_dim=1)
        self.classifier = nn.Sequential(nn.Linear(LAST_CONV_CHANNELS, LAST_CHANNEL), nn.Hardswish(),
                                        nn.Dropout(dropout), nn.Linear(LAST_CHANNEL, num_classes))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.flatten(self.pool(self.conv(h))))


class MobileNetV3Small(nn.Module):
    task = "classify"

    def __init__(self, config: MobileNetV3Config) -> None:
        super().__init__()
        self.config = config
        self.embed = conv_norm_act(config.in_channels, STEM_CHANNELS, 3, stride=config.stem_stride,
                                   activation=nn.Hardswish)
        blocks = []
        channels = STEM_CHANNELS
        for spec in SMALL_BOTTLENECKS:
            blocks.append(InvertedResidual(channels, spec))
            channels = spec.out
        self.blocks = nn.ModuleList(blocks)
        self.head = MobileNetHead(channels, config.num_classes, config.dropout)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        # The reference init: He-normal convs (fan_out) with zero bias, unit BN, N(0, 0.01) linears.
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out")
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0, 0.01)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build_mobilenetv3_small(config: MobileNetV3Config) -> MobileNetV3Small:
    return seeded_build(config.seed, lambda: MobileNetV3Small(config))


def mobilenetv3_small_cifar_config() -> MobileNetV3Config:
    """10 classes at 32x32: stride-1 stem, no dropout (see the module docstring)."""
    return MobileNetV3Config(num_classes=10, stem_stride=1, dropout=0.0)


@MODEL_PRESETS.register("mobilenetv3-small")
def mobilenetv3_small() -> MobileNetV3Small:
    """The reference model: 1000 classes, 3x224x224 inputs."""
    return build_mobilenetv3_small(MobileNetV3Config())


@MODEL_PRESETS.register("mobilenetv3-small-cifar")
def mobilenetv3_small_cifar() -> MobileNetV3Small:
    return build_mobilenetv3_small(mobilenetv3_small_cifar_config())
