"""Training-only adapters from a segment's output to the tensors the global head consumes.

As SegProp defines them (appendix B.6): for convolutional states one 1x1 convolution whose stride
takes the map to the head's spatial size, then BatchNorm and ReLU, its channels split into the head's
input tensors when the head takes several (ResNet's (I, P) pair); for transformer states ([B, T, d])
a linear map; the identity when the shapes already match. Layer-wise training puts a fresh copy of
the task head after such an adapter as each stage's auxiliary classifier (GAP + Linear for a ResNet).
"""
from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from edgetrain.methods.segprop.views import Spec, batch_free
from edgetrain.registry import EdgetrainError


class ConvAdapter(nn.Module):
    """[B, C, H, W] -> [B, sum(out_channels), h, w] by a 1x1 conv of stride H/h (+ BN + ReLU), split
    into one tensor per entry of `out_channels` (a tuple) or returned whole (one entry, `single`)."""

    def __init__(self, in_channels: int, out_channels: tuple[int, ...], in_hw: tuple[int, int],
                 out_hw: tuple[int, int], single: bool, norm_groups: int = 0) -> None:
        super().__init__()
        if out_hw[0] > in_hw[0] or out_hw[1] > in_hw[1]:
            raise EdgetrainError(f"no adapter upsamples: a {in_hw} map cannot feed a head that takes {out_hw}")
        stride = (in_hw[0] // out_hw[0], in_hw[1] // out_hw[1])
        self.out_channels, self.single = tuple(out_channels), single
        self.conv = nn.Conv2d(in_channels, sum(out_channels), 1, stride=stride, bias=False)
        # BatchNorm as the paper; GroupNorm (norm_groups > 0) for models that avoid batch statistics.
        self.norm = (nn.GroupNorm(norm_groups, sum(out_channels)) if norm_groups
                     else nn.BatchNorm2d(sum(out_channels)))
        self.act = nn.ReLU()
        exact = all(i // s == o and i % s == 0 for i, s, o in zip(in_hw, stride, out_hw))
        # Sizes that do not divide (an odd map, say) are finished by average pooling.
        self.pool: nn.Module = nn.Identity() if exact else nn.AdaptiveAvgPool2d(out_hw)
        nn.init.kaiming_normal_(self.conv.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, h: torch.Tensor) -> Any:
        out = self.act(self.norm(self.pool(self.conv(h))))
        if self.single:
            return out
        return tuple(torch.split(out, self.out_channels, dim=1))


class LinearAdapter(nn.Module):
    """[..., d_in] -> [..., d_out] (transformer states), split along the last dimension for tuples."""

    def __init__(self, in_features: int, out_features: tuple[int, ...], single: bool) -> None:
        super().__init__()
        self.out_features, self.single = tuple(out_features), single
        self.proj = nn.Linear(in_features, sum(out_features))

    def forward(self, h: torch.Tensor) -> Any:
        out = self.proj(h)
        return out if self.single else tuple(torch.split(out, self.out_features, dim=-1))


class FlattenLinear(nn.Module):
    """[B, ...] -> [B, features] (a conv map feeding a dense head), + ReLU."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, out_features)
        self.act = nn.ReLU()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.act(self.proj(h.flatten(1)))


def model_norm_groups(model: nn.Module) -> int:
    """0 when `model` uses BatchNorm (or no norm), else the group count of its first GroupNorm: conv
    adapters then normalise the same way, so a model without batch statistics gets none from them."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            return 0
    for module in model.modules():
        if isinstance(module, nn.GroupNorm):
            return module.num_groups
    return 0


def make_adapter(source: Spec, target: Spec, kind: str = "auto", norm_groups: int = 0) -> nn.Module | None:
    """An adapter from states shaped `source` to states shaped `target` (batch dimension ignored);
    None when they already match (the identity). kind: "auto", "identity", "conv" or "linear";
    norm_groups > 0 puts GroupNorm instead of BatchNorm in a conv adapter."""
    src, dst = batch_free(source), batch_free(target)
    if kind not in ("auto", "identity", "conv", "linear"):
        raise EdgetrainError(f"unknown adapter kind {kind!r}; known: auto, identity, conv, linear")
    if src == dst and kind in ("auto", "identity"):
        return None
    if kind == "identity":
        raise EdgetrainError(f"adapter 'identity' cannot map states {src} to {dst}")
    if isinstance(source, tuple) and not isinstance(source, torch.Size):
        raise EdgetrainError(f"no adapter takes a tuple state {src}; pass adapters= with your own module")
    single = isinstance(target, torch.Size)
    parts = [dst] if single else list(dst)
    if len(src) == 3 and all(len(p) == 3 for p in parts) and kind in ("auto", "conv"):
        hw = {tuple(p[1:]) for p in parts}
        if len(hw) != 1:
            raise EdgetrainError(f"the head's input tensors {dst} differ in spatial size; no one-conv adapter")
        channels = tuple(p[0] for p in parts)
        groups = norm_groups if norm_groups and sum(channels) % norm_groups == 0 else (1 if norm_groups else 0)
        return ConvAdapter(src[0], channels, tuple(src[1:]), hw.pop(), single, groups)
    if len(src) >= 1 and all(len(p) == len(src) and p[:-1] == src[:-1] for p in parts) \
            and kind in ("auto", "linear"):
        return LinearAdapter(src[-1], tuple(p[-1] for p in parts), single)
    if single and len(dst) == 1 and kind in ("auto", "linear"):
        return FlattenLinear(math.prod(src), dst[0])
    raise EdgetrainError(f"no {kind} adapter maps states {src} to {dst}; pass adapters= with your own module")


def fresh_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` with every parameter re-initialised (reset_parameters of each submodule)."""
    clone = copy.deepcopy(module)
    for sub in clone.modules():
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
    for param in clone.parameters():
        param.requires_grad_(True)
    return clone


class PooledLinear(nn.Module):
    """Global average pooling + Linear: the paper's local classifier on a [B, C, H, W] map."""

    def __init__(self, channels: int, num_outputs: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_outputs)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(h).flatten(1))


AUX_HEADS = ("auto", "linear", "copy")


class AuxiliaryClassifier(nn.Module):
    """Layer-wise training's local head: an adapter to the task head's input shape, then a classifier.

    aux_head "linear" is the paper's (appendix B.2.3): GAP + Linear on the canonical map; "copy" is a
    freshly initialised copy of the model's task head (LayerNorm + Linear for a ViT, norm + LM head for
    a decoder); "auto" takes "linear" for conv maps ([B, C, H, W]) and "copy" otherwise."""

    def __init__(self, adapter: nn.Module | None, head: nn.Module, head_input: Spec, num_outputs: int,
                 aux_head: str = "auto") -> None:
        super().__init__()
        if aux_head not in AUX_HEADS:
            raise EdgetrainError(f"unknown aux_head {aux_head!r}; known: {', '.join(AUX_HEADS)}")
        conv_map = isinstance(head_input, torch.Size) and len(head_input) == 4
        if aux_head == "linear" and not conv_map:
            raise EdgetrainError(f"aux_head 'linear' needs a [B, C, H, W] head input; this head takes {head_input}")
        self.adapter = adapter if adapter is not None else nn.Identity()
        if aux_head == "copy" or not conv_map:
            self.head: nn.Module = fresh_copy(head)
        else:
            self.head = PooledLinear(head_input[1], num_outputs)

    def forward(self, h: Any) -> Any:
        return self.head(self.adapter(h))
