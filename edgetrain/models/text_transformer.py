"""Transformer-encoder text classifier over token ids [B, T].

Block view: embed = token embedding + learned position embedding ([B, T] -> [B, T, dim]), blocks =
pre-norm encoder blocks (the ViT block: bidirectional self-attention + GELU MLP), head = LayerNorm,
mean over positions, then Linear (or Linear-Tanh-Linear when `head_hidden` is set, the classifier
SCPL puts on its text models).

Pooling is a mean over all T positions, not a class token: inputs are fixed-length windows of a
byte stream without padding (the block view carries one tensor, so there is no mask to pass along),
and a mean gives every position a direct path to the loss, which local-objective methods (SCPL)
and forward gradients both benefit from. Pad-free batches are the caller's contract.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from edgetrain.models.llama import ConfigError
from edgetrain.models.mlp import check_positive_ints, seeded_build
from edgetrain.models.vit import LAYER_NORM_EPS, EncoderBlock, init_transformer_weights
from edgetrain.models.zoo import MODEL_PRESETS
from edgetrain.registry import EdgetrainError


@dataclass
class TextTransformerConfig:
    vocab_size: int = 256  # byte-level tokens
    dim: int = 128
    depth: int = 2
    num_heads: int = 4
    mlp_ratio: int = 4  # MLP hidden width = mlp_ratio * dim
    max_len: int = 512  # rows of the position table: the longest sequence the model accepts
    num_classes: int = 4
    head_hidden: int | None = None  # None: Linear head; n: Linear(dim, n) - Tanh - Linear(n, classes)
    seed: int | None = 0  # weights are a function of the config; None draws from the global RNG

    def __post_init__(self) -> None:
        check_positive_ints(self, "vocab_size", "dim", "depth", "num_heads", "mlp_ratio", "max_len",
                            "num_classes")
        if self.head_hidden is not None:
            check_positive_ints(self, "head_hidden")
        if self.dim % self.num_heads:
            raise ConfigError(f"TextTransformerConfig.num_heads = {self.num_heads}: must divide dim ({self.dim})")


class TokenPositionEmbedding(nn.Module):
    def __init__(self, config: TextTransformerConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab_size, config.dim)
        self.positions = nn.Embedding(config.max_len, config.dim)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        seq_len = token_ids.shape[1]
        if seq_len > self.positions.num_embeddings:
            raise EdgetrainError(f"sequence of {seq_len} tokens is longer than the model's max_len "
                                 f"({self.positions.num_embeddings}); cut the input or build with a larger max_len")
        positions = torch.arange(seq_len, device=token_ids.device)
        return self.tokens(token_ids) + self.positions(positions)


def classifier(in_features: int, num_classes: int, hidden: int | None) -> nn.Module:
    if hidden is None:
        return nn.Linear(in_features, num_classes)
    return nn.Sequential(nn.Linear(in_features, hidden), nn.Tanh(), nn.Linear(hidden, num_classes))


class MeanPoolHead(nn.Module):
    """[B, T, dim] -> LayerNorm (pre-norm blocks leave the residual stream unnormalised) -> mean over T -> logits."""

    def __init__(self, dim: int, num_classes: int, hidden: int | None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.fc = classifier(dim, num_classes, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(h).mean(dim=1))


class TextTransformer(nn.Module):
    task = "classify"

    def __init__(self, config: TextTransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = TokenPositionEmbedding(config)
        self.blocks = nn.ModuleList(EncoderBlock(config.dim, config.num_heads, config.mlp_ratio * config.dim)
                                    for _ in range(config.depth))
        self.head = MeanPoolHead(config.dim, config.num_classes, config.head_hidden)
        init_transformer_weights(self)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(token_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build_text_transformer(config: TextTransformerConfig) -> TextTransformer:
    return seeded_build(config.seed, lambda: TextTransformer(config))


def transformer_text_config() -> TextTransformerConfig:
    """Byte-level 4-class classifier (AG News sized): dim 128, 2 blocks of 4 heads, up to 512 bytes."""
    return TextTransformerConfig(vocab_size=256, dim=128, depth=2, num_heads=4, mlp_ratio=4, max_len=512,
                                 num_classes=4)


@MODEL_PRESETS.register("transformer-text")
def transformer_text() -> TextTransformer:
    return build_text_transformer(transformer_text_config())
