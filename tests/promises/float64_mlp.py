"""The small float64 model and data of the promise tests: an MLP with a block view (embed, blocks,
head), tanh so that every gradient is non-zero, and Gaussian feature batches with 3 classes."""
from __future__ import annotations

import torch
from torch import nn

from edgetrain.data.batch import Batch
from edgetrain.models.mlp import MLPConfig, build_mlp


def mlp_float64(hidden_sizes: tuple[int, ...] = (6, 5)) -> nn.Module:
    return build_mlp(MLPConfig(input_shape=(8,), hidden_sizes=hidden_sizes, num_classes=3, activation="tanh",
                               seed=0)).double()


def feature_batches(count: int, seed: int = 0) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    return [Batch(torch.randn(12, 8, generator=generator, dtype=torch.float64),
                  torch.randint(0, 3, (12,), generator=generator), i) for i in range(count)]
