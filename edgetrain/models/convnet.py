"""Small ConvNets: conv stages [Conv2d (+BatchNorm2d) + activation + MaxPool] then dense layers.

Block view: embed reshapes flat inputs to the image shape (no weights), one block per conv stage and
per hidden dense layer, head = flatten + the output Linear.

Presets follow the AsyncFGD paper (Appendix H.2, Tables 8 and 11):
  ConvS: conv 32 (5x5, padding 2) + act + maxpool 2 -> Linear 1000 + act -> Linear 10.
  ConvL: five stages of conv (3x3, stride 1, padding 2) + BatchNorm2d + act + maxpool 2 with
         32, 64, 128, 256, 512 channels -> Linear 10.
ConvL's padding of 2 on a 3x3 kernel is what the table says (each conv grows the map by 2 pixels);
we keep it, so the last map is 512x2x2 for both MNIST (28) and CIFAR (32) inputs. Convs in front of
BatchNorm have no bias (the norm cancels it).
The plain presets take MNIST's 1x28x28, `-cifar` ones 3x32x32; a bare name is the Tanh variant.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from edgetrain.models.llama import ConfigError
from edgetrain.models.mlp import (ACTIVATIONS, CIFAR_SHAPE, MNIST_SHAPE, HiddenLayer, check_choice,
                                  check_positive_ints, seeded_build)
from edgetrain.models.zoo import MODEL_PRESETS
from edgetrain.registry import EdgetrainError


@dataclass
class ConvNetConfig:
    input_shape: tuple[int, int, int] = MNIST_SHAPE  # (channels, height, width)
    channels: tuple[int, ...] = (32,)  # one conv stage per entry
    kernel_size: int = 5
    padding: int = 2
    pool: int = 2  # max-pool kernel and stride after every conv; 1 = no pooling
    batch_norm: bool = False
    hidden_sizes: tuple[int, ...] = (1000,)  # dense layers between the last stage and the output
    num_classes: int = 10
    activation: str = "tanh"
    seed: int | None = 0  # weights are a function of the config; None draws from the global RNG

    def __post_init__(self) -> None:
        self.input_shape = tuple(self.input_shape)  # type: ignore[assignment]
        self.channels = tuple(self.channels)
        self.hidden_sizes = tuple(self.hidden_sizes)
        if len(self.input_shape) != 3:
            raise ConfigError(f"ConvNetConfig.input_shape = {self.input_shape!r}: must be (C, H, W)")
        check_positive_ints(self, "input_shape", "channels", "kernel_size", "pool", "num_classes")
        if self.hidden_sizes:
            check_positive_ints(self, "hidden_sizes")
        if not (isinstance(self.padding, int) and self.padding >= 0):
            raise ConfigError(f"ConvNetConfig.padding = {self.padding!r}: must be an integer >= 0")
        check_choice(self, "activation", ACTIVATIONS)
        height, width = self.feature_map_size()
        if height < 1 or width < 1:
            raise ConfigError(f"ConvNetConfig: a {self.input_shape} input shrinks to nothing through "
                              f"{len(self.channels)} stages; use fewer stages or less pooling")

    def feature_map_size(self) -> tuple[int, int]:
        """(H, W) after the last stage: conv (stride 1) changes a side by 2*padding - kernel + 1,
        the max-pool floors it by `pool`."""
        sides = list(self.input_shape[1:])
        for _ in self.channels:
            sides = [(side + 2 * self.padding - self.kernel_size + 1) // self.pool for side in sides]
        return sides[0], sides[1]

    @property
    def flat_features(self) -> int:
        return self.channels[-1] * math.prod(self.feature_map_size())


class ToImage(nn.Module):
    """[B, C*H*W] or [B, C, H, W] -> [B, C, H, W], so flat feature vectors (scikit-learn digits) fit too."""

    def __init__(self, shape: tuple[int, int, int]) -> None:
        super().__init__()
        self.shape = shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x[0].numel() != math.prod(self.shape):
            raise EdgetrainError(f"input of shape {tuple(x.shape)} does not hold {self.shape} images; "
                                 f"expected [B, {', '.join(map(str, self.shape))}] or [B, {math.prod(self.shape)}]")
        return x.reshape(x.shape[0], *self.shape)


class ConvStage(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, config: ConvNetConfig) -> None:
        super().__init__()
        # No bias in front of BatchNorm: the norm subtracts it again, so it would never get a gradient.
        self.conv = nn.Conv2d(in_channels, out_channels, config.kernel_size, stride=1, padding=config.padding,
                              bias=not config.batch_norm)
        self.norm = nn.BatchNorm2d(out_channels) if config.batch_norm else nn.Identity()
        self.act = ACTIVATIONS[config.activation]()
        self.pool = nn.MaxPool2d(config.pool) if config.pool > 1 else nn.Identity()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.pool(self.act(self.norm(self.conv(h))))


class DenseStage(nn.Module):
    """Flatten (a no-op after the first dense stage) + Linear (+BatchNorm1d) + activation."""

    def __init__(self, in_features: int, out_features: int, config: ConvNetConfig) -> None:
        super().__init__()
        self.flatten = nn.Flatten(start_dim=1)
        self.layer = HiddenLayer(in_features, out_features, config.activation, config.batch_norm)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.layer(self.flatten(h))


class ConvNet(nn.Module):
    task = "classify"

    def __init__(self, config: ConvNetConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = ToImage(config.input_shape)
        in_channels = (config.input_shape[0], *config.channels)
        blocks: list[nn.Module] = [ConvStage(c_in, c_out, config)
                                   for c_in, c_out in zip(in_channels[:-1], in_channels[1:])]
        widths = (config.flat_features, *config.hidden_sizes)
        blocks += [DenseStage(w_in, w_out, config) for w_in, w_out in zip(widths[:-1], widths[1:])]
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Sequential(nn.Flatten(start_dim=1), nn.Linear(widths[-1], config.num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build_convnet(config: ConvNetConfig) -> ConvNet:
    """A freshly initialised ConvNet (PyTorch default init, as the paper); reproducible when config.seed is set."""
    return seeded_build(config.seed, lambda: ConvNet(config))


def convs_config(activation: str = "tanh", input_shape: tuple[int, int, int] = MNIST_SHAPE) -> ConvNetConfig:
    """ConvS of AsyncFGD (Table 8)."""
    return ConvNetConfig(input_shape=input_shape, channels=(32,), kernel_size=5, padding=2, pool=2,
                         batch_norm=False, hidden_sizes=(1000,), num_classes=10, activation=activation)


def convl_config(activation: str = "tanh", input_shape: tuple[int, int, int] = MNIST_SHAPE) -> ConvNetConfig:
    """ConvL of AsyncFGD (Table 11)."""
    return ConvNetConfig(input_shape=input_shape, channels=(32, 64, 128, 256, 512), kernel_size=3, padding=2,
                         pool=2, batch_norm=True, hidden_sizes=(), num_classes=10, activation=activation)


def digits_convnet_config() -> ConvNetConfig:
    """For scikit-learn's 8x8 digits: two 3x3 stages (16, 32 channels; 8 -> 4 -> 2 pixels), a 64-wide
    dense layer, ReLU. The conv stages make a feature extractor worth freezing in transfer learning;
    the dense block and head are what a transferred model retrains."""
    return ConvNetConfig(input_shape=(1, 8, 8), channels=(16, 32), kernel_size=3, padding=1, pool=2,
                         batch_norm=False, hidden_sizes=(64,), num_classes=10, activation="relu")


def _preset(make_config: Callable[..., ConvNetConfig], activation: str,
            input_shape: tuple[int, int, int]) -> Callable[[], ConvNet]:
    return lambda: build_convnet(make_config(activation, input_shape))


# Spelled out (not generated from a product) so that a preset name can be found with grep.
for _name, (_make, _activation, _shape) in {
    "convs": (convs_config, "tanh", MNIST_SHAPE),
    "convs-tanh": (convs_config, "tanh", MNIST_SHAPE),
    "convs-relu": (convs_config, "relu", MNIST_SHAPE),
    "convs-tanh-cifar": (convs_config, "tanh", CIFAR_SHAPE),
    "convs-relu-cifar": (convs_config, "relu", CIFAR_SHAPE),
    "convl": (convl_config, "tanh", MNIST_SHAPE),
    "convl-tanh": (convl_config, "tanh", MNIST_SHAPE),
    "convl-relu": (convl_config, "relu", MNIST_SHAPE),
    "convl-tanh-cifar": (convl_config, "tanh", CIFAR_SHAPE),
    "convl-relu-cifar": (convl_config, "relu", CIFAR_SHAPE),
}.items():
    MODEL_PRESETS.add(_name, _preset(_make, _activation, _shape))


@MODEL_PRESETS.register("convnet-digits")
def convnet_digits() -> ConvNet:
    return build_convnet(digits_convnet_config())
