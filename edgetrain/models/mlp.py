"""MLP classifier: flatten -> [Linear (+BatchNorm1d) + activation] per hidden layer -> Linear.

Block view: embed = flatten (no weights), one block per hidden layer, head = the output Linear.
Keeping every hidden layer a block of the same shape is what lets the pipelined forward-gradient
methods cut the network anywhere (AsyncFGD splits FCS one hidden layer per worker).

Presets follow the AsyncFGD paper (Appendix H.2, Tables 9 and 10):
  FCS: 1024-512-256 hidden, no normalisation.
  FCL: 1024-1024-1024-1024-512 hidden, each with BatchNorm1d ("the larger models incorporate batch
       normalization"), then Linear(512, 10). A Linear in front of BatchNorm has no bias here: the
       norm cancels it, so it could never learn (and would only add noise to perturbation methods).
Table 9 stops at fc3 (out 256) without an output layer, but the model split of Table 5 puts an
activation after fc3, so fc3 is a hidden layer and the 10-way output Linear is implied; we add it.
The paper trains on MNIST and CIFAR-10; the plain presets take MNIST's 1x28x28, `-cifar` ones 3x32x32.
A bare name (`fcs`) is the Tanh variant, listed first in the paper's Table 1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Collection, TypeVar

import torch
from torch import nn

from edgetrain.models.llama import ConfigError
from edgetrain.models.zoo import MODEL_PRESETS

# Only the two the paper compares: forward-gradient methods behave very differently under each.
ACTIVATIONS: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU}

M = TypeVar("M", bound=nn.Module)

MNIST_SHAPE = (1, 28, 28)
CIFAR_SHAPE = (3, 32, 32)


# The helpers below are shared by the other small-model files of the zoo (convnet, resnet, vit, ...).

def seeded_build(seed: int | None, make: Callable[[], M]) -> M:
    """make() with the global RNG seeded, then restored: a preset's weights are a function of its config
    (every rank of a data-parallel run builds the same model) and building one disturbs no caller."""
    if seed is None:
        return make()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make()


def check_positive_ints(owner: object, *names: str) -> None:
    """Raise ConfigError naming the first field that is not a positive int (or tuple of them)."""
    for name in names:
        value = getattr(owner, name)
        values = value if isinstance(value, tuple) else (value,)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
            raise ConfigError(f"{type(owner).__name__}.{name} = {value!r}: must be positive integer(s)")


def check_choice(owner: object, name: str, choices: Collection[str]) -> None:
    value = getattr(owner, name)
    if value not in choices:
        raise ConfigError(f"{type(owner).__name__}.{name} = {value!r}: must be one of "
                          f"{', '.join(map(repr, choices))}")


@dataclass
class MLPConfig:
    input_shape: tuple[int, ...] = MNIST_SHAPE  # per-sample shape; flattened, so (64,) and (1, 8, 8) agree
    hidden_sizes: tuple[int, ...] = (1024, 512, 256)
    num_classes: int = 10
    activation: str = "tanh"
    batch_norm: bool = False
    seed: int | None = 0  # weights are a function of the config; None draws from the global RNG

    def __post_init__(self) -> None:
        # Configs read from JSON arrive with lists.
        self.input_shape = tuple(self.input_shape)
        self.hidden_sizes = tuple(self.hidden_sizes)
        check_positive_ints(self, "input_shape", "num_classes")
        if self.hidden_sizes:
            check_positive_ints(self, "hidden_sizes")
        check_choice(self, "activation", ACTIVATIONS)

    @property
    def input_dim(self) -> int:
        return math.prod(self.input_shape)


class HiddenLayer(nn.Module):
    def __init__(self, in_features: int, out_features: int, activation: str, batch_norm: bool) -> None:
        super().__init__()
        # No bias in front of BatchNorm: the norm subtracts it again, so it would never get a gradient.
        self.linear = nn.Linear(in_features, out_features, bias=not batch_norm)
        self.norm = nn.BatchNorm1d(out_features) if batch_norm else nn.Identity()
        self.act = ACTIVATIONS[activation]()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(self.linear(h)))


class MLP(nn.Module):
    """Flatten -> hidden layers (the blocks) -> Linear head; a classifier over [B, *input_shape]."""

    task = "classify"

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Flatten(start_dim=1)
        widths = (config.input_dim, *config.hidden_sizes)
        self.blocks = nn.ModuleList(HiddenLayer(w_in, w_out, config.activation, config.batch_norm)
                                    for w_in, w_out in zip(widths[:-1], widths[1:]))
        self.head = nn.Linear(widths[-1], config.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build_mlp(config: MLPConfig) -> MLP:
    """A freshly initialised MLP (PyTorch default init, as the paper); reproducible when config.seed is set."""
    return seeded_build(config.seed, lambda: MLP(config))


def fcs_config(activation: str = "tanh", input_shape: tuple[int, ...] = MNIST_SHAPE) -> MLPConfig:
    """FCS of AsyncFGD (Table 9)."""
    return MLPConfig(input_shape=input_shape, hidden_sizes=(1024, 512, 256), num_classes=10,
                     activation=activation, batch_norm=False)


def fcl_config(activation: str = "tanh", input_shape: tuple[int, ...] = MNIST_SHAPE) -> MLPConfig:
    """FCL of AsyncFGD (Table 10)."""
    return MLPConfig(input_shape=input_shape, hidden_sizes=(1024, 1024, 1024, 1024, 512), num_classes=10,
                     activation=activation, batch_norm=True)


def digits_mlp_config() -> MLPConfig:
    """64-32-10 Tanh MLP for scikit-learn's 8x8 digits: small enough to train in seconds on any CPU."""
    return MLPConfig(input_shape=(64,), hidden_sizes=(32,), num_classes=10, activation="tanh")


def _preset(make_config: Callable[..., MLPConfig], activation: str,
            input_shape: tuple[int, ...]) -> Callable[[], MLP]:
    return lambda: build_mlp(make_config(activation, input_shape))


# Spelled out (not generated from a product) so that a preset name can be found with grep.
for _name, (_make, _activation, _shape) in {
    "fcs": (fcs_config, "tanh", MNIST_SHAPE),
    "fcs-tanh": (fcs_config, "tanh", MNIST_SHAPE),
    "fcs-relu": (fcs_config, "relu", MNIST_SHAPE),
    "fcs-tanh-cifar": (fcs_config, "tanh", CIFAR_SHAPE),
    "fcs-relu-cifar": (fcs_config, "relu", CIFAR_SHAPE),
    "fcl": (fcl_config, "tanh", MNIST_SHAPE),
    "fcl-tanh": (fcl_config, "tanh", MNIST_SHAPE),
    "fcl-relu": (fcl_config, "relu", MNIST_SHAPE),
    "fcl-tanh-cifar": (fcl_config, "tanh", CIFAR_SHAPE),
    "fcl-relu-cifar": (fcl_config, "relu", CIFAR_SHAPE),
}.items():
    MODEL_PRESETS.add(_name, _preset(_make, _activation, _shape))


@MODEL_PRESETS.register("mlp-digits")
def mlp_digits() -> MLP:
    return build_mlp(digits_mlp_config())
