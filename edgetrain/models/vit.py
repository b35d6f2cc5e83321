"""Vision Transformer (Dosovitskiy et al. 2021), small: patch embedding -> pre-norm encoder blocks -> head.

Block view: embed = patch projection + class token + learned position embedding, blocks = the
encoder blocks ([B, 1 + patches, dim] -> same), head = LayerNorm + Linear on the class token.

The encoder block here (bidirectional self-attention + GELU MLP, both pre-norm with residuals) is
also the block of the text transformer (edgetrain.models.text_transformer).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from edgetrain.models.llama import ConfigError
from edgetrain.models.mlp import check_positive_ints, seeded_build
from edgetrain.models.zoo import MODEL_PRESETS
from edgetrain.registry import EdgetrainError

LAYER_NORM_EPS = 1e-6  # as the reference ViT


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Unmasked scaled dot-product attention over [B, heads, T, head_dim].

    The fused CPU and CUDA kernels have no forward-mode AD, which the forward-gradient methods
    (FGD, AsyncFGD) run through the model; for them we fall back to the math kernel, which is built
    from differentiable primitives. Same result either way, the fused one is just faster.
    """
    try:
        return F.scaled_dot_product_attention(q, k, v)
    except NotImplementedError:
        with sdpa_kernel([SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q, k, v)


class SelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, dim = x.shape
        q, k, v = self.qkv(x).view(batch, seq_len, 3, self.num_heads, dim // self.num_heads).permute(2, 0, 3, 1, 4)
        return self.proj(attention(q, k, v).transpose(1, 2).reshape(batch, seq_len, dim))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderBlock(nn.Module):
    """Pre-norm transformer encoder block: h + attn(norm(h)), then h + mlp(norm(h)); [B, T, dim] -> same."""

    def __init__(self, dim: int, num_heads: int, mlp_hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.attn = SelfAttention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.mlp = FeedForward(dim, mlp_hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.norm1(h))
        return h + self.mlp(self.norm2(h))


@torch.no_grad()
def init_transformer_weights(model: nn.Module, std: float = 0.02) -> None:
    """Truncated-normal(std) linears and embeddings with zero biases, unit LayerNorms (the ViT/BERT init)."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.trunc_normal_(module.weight, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)


@dataclass
class ViTConfig:
    image_size: int = 32
    patch_size: int = 4
    in_channels: int = 3
    dim: int = 192
    depth: int = 6
    num_heads: int = 3
    mlp_ratio: int = 4  # MLP hidden width = mlp_ratio * dim
    num_classes: int = 10
    seed: int | None = 0  # weights are a function of the config; None draws from the global RNG

    def __post_init__(self) -> None:
        check_positive_ints(self, "image_size", "patch_size", "in_channels", "dim", "depth", "num_heads",
                            "mlp_ratio", "num_classes")
        if self.image_size % self.patch_size:
            raise ConfigError(f"ViTConfig.patch_size = {self.patch_size}: must divide image_size "
                              f"({self.image_size})")
        if self.dim % self.num_heads:
            raise ConfigError(f"ViTConfig.num_heads = {self.num_heads}: must divide dim ({self.dim})")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class PatchEmbedding(nn.Module):
    """[B, C, H, W] -> [B, 1 + patches, dim]: non-overlapping patches projected, class token prepended,
    position embedding added."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.image_size = config.image_size
        self.proj = nn.Conv2d(config.in_channels, config.dim, config.patch_size, stride=config.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + config.num_patches, config.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2:] != (self.image_size, self.image_size):
            # The position table is sized for one resolution; a silent broadcast error would be worse.
            raise EdgetrainError(f"ViT built for {self.image_size}x{self.image_size} images got {tuple(x.shape)}")
        patches = self.proj(x).flatten(2).transpose(1, 2)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        return torch.cat([cls, patches], dim=1) + self.pos_embed


class ClassTokenHead(nn.Module):
    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(h[:, 0]))


class ViT(nn.Module):
    task = "classify"

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = PatchEmbedding(config)
        self.blocks = nn.ModuleList(EncoderBlock(config.dim, config.num_heads, config.mlp_ratio * config.dim)
                                    for _ in range(config.depth))
        self.head = ClassTokenHead(config.dim, config.num_classes)
        init_transformer_weights(self)
        with torch.no_grad():
            nn.init.trunc_normal_(self.embed.pos_embed, std=0.02)
            nn.init.trunc_normal_(self.embed.cls_token, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build_vit(config: ViTConfig) -> ViT:
    return seeded_build(config.seed, lambda: ViT(config))


def vit_tiny_cifar_config() -> ViTConfig:
    """ViT-Tiny width (192, 3 heads) at half depth, 4x4 patches of a 32x32 image: 64 patches + class token."""
    return ViTConfig(image_size=32, patch_size=4, in_channels=3, dim=192, depth=6, num_heads=3, mlp_ratio=4,
                     num_classes=10)


@MODEL_PRESETS.register("vit-tiny-cifar")
def vit_tiny_cifar() -> ViT:
    return build_vit(vit_tiny_cifar_config())
