"""Frozen base weights kept in 4 or 8 bits on torch, dequantised one layer at a time.

A decoder's block projections are most of its memory. `QuantizedLinear` holds one as unsigned integers
packed along each row (two 4-bit values a byte, or one 8-bit value), with a scale and a bias per group of
`group_size` inputs: w = scale * q + bias, MLX's affine layout (edgetrain.models.gguf.packed). GGUF's
Q4_0, Q4_1 and Q8_0 blocks map onto it exactly, so a GGUF model loads without requantising
(`load_model(path.gguf, quantized=True)`); dense weights are quantised on load per group from their
minimum and maximum (`load_model(..., quantize_bits=4)`, or edgetrain.models.quantize.quantize_linears(model, 4)).

The dense weight exists only while one layer computes with it: the forward dequantises, multiplies and
drops it; the backward (the weight is frozen, so only dL/dx = dL/dy W is needed) dequantises it again
rather than keeping it from the forward. `mesp` takes the same path through `LinearWeights.dense_weight`,
in its recompute and in its backward. LoRA and gradients stay in the training dtype. Gradients equal
autograd through the dequantised weights (tests/models/test_quantized.py).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from edgetrain.registry import EdgetrainError

GROUP_SIZE = 32
SUPPORTED_BITS = (4, 8)


class QuantizedMatmul(torch.autograd.Function):
    """x W^T with W dequantised from `layer` in the forward and again in the backward (never saved)."""

    @staticmethod
    def forward(x: torch.Tensor, layer: "QuantizedLinear") -> torch.Tensor:
        return x @ layer.dequantize(x.dtype, x.device).T

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.layer = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad_output @ ctx.layer.dequantize(grad_output.dtype, grad_output.device), None

    @staticmethod
    def jvp(ctx: Any, x_tangent: torch.Tensor, _: Any) -> torch.Tensor:
        return x_tangent @ ctx.layer.dequantize(x_tangent.dtype, x_tangent.device).T


class QuantizedLinear(nn.Module):
    """A frozen y = x W^T (+ b) whose W is held packed (see the module docstring). Its tensors are buffers:
    nothing here trains. `weight` gives the dequantised matrix for code that reads it (an export, a merge);
    the forward never holds it longer than one product."""

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int = GROUP_SIZE,
                 bias: bool = False, device: Any = None) -> None:
        super().__init__()
        if bits not in SUPPORTED_BITS:
            raise EdgetrainError(f"quantised weights take {' or '.join(map(str, SUPPORTED_BITS))} bits, not {bits!r}")
        if group_size <= 0 or in_features % group_size:
            raise EdgetrainError(f"a layer of {in_features} inputs cannot be cut into groups of {group_size}")
        self.in_features, self.out_features, self.bits, self.group_size = in_features, out_features, bits, group_size
        groups = in_features // group_size
        self.register_buffer("codes", torch.zeros(out_features, in_features * bits // 8, dtype=torch.uint8,
                                                  device=device))
        self.register_buffer("scales", torch.zeros(out_features, groups, device=device))
        self.register_buffer("biases", torch.zeros(out_features, groups, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, bias={self.bias is not None}")

    def dequantize(self, dtype: torch.dtype | None = None, device: Any = None) -> torch.Tensor:
        """The dense [out, in] weight: scale * q + bias per group, computed in the scales' dtype."""
        codes = self.codes if device is None else self.codes.to(device)
        if self.bits == 4:  # byte i holds inputs 2i (low nibble) and 2i + 1 (high nibble)
            q = torch.stack((codes & 0x0F, codes >> 4), dim=-1).reshape(self.out_features, self.in_features)
        else:
            q = codes
        scales = self.scales if device is None else self.scales.to(device)
        biases = self.biases if device is None else self.biases.to(device)
        grouped = q.reshape(self.out_features, -1, self.group_size).to(scales.dtype)
        weight = (grouped * scales.unsqueeze(-1) + biases.unsqueeze(-1)).reshape(self.out_features, self.in_features)
        return weight if dtype is None else weight.to(dtype)

    @property
    def weight(self) -> torch.Tensor:
        return self.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = QuantizedMatmul.apply(x, self)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @classmethod
    def from_packed(cls, packed: Any, bias: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.float32) -> "QuantizedLinear":
        """From an edgetrain.models.gguf.packed.PackedWeight (GGUF blocks, moved, not requantised)."""
        rows = packed.weight.shape[0]
        codes = np.ascontiguousarray(packed.weight).view(np.uint8)  # little-endian words -> their bytes
        layer = cls(codes.shape[1] * 8 // packed.bits, rows, packed.bits, packed.group_size, bias is not None)
        layer.codes = torch.from_numpy(codes.copy())
        layer.scales = torch.from_numpy(np.asarray(packed.scales, dtype=np.float32)).to(dtype)
        layer.biases = torch.from_numpy(np.asarray(packed.biases, dtype=np.float32)).to(dtype)
        if bias is not None:
            layer.bias = bias.detach().to(dtype).clone()
        return layer

    @classmethod
    def from_dense(cls, weight: torch.Tensor, bits: int, bias: torch.Tensor | None = None,
                   group_size: int = GROUP_SIZE) -> "QuantizedLinear":
        """Quantise a dense [out, in] weight per group of `group_size` inputs: bias = the group's minimum,
        scale = its range / (2**bits - 1), q = round((w - bias) / scale); a constant group is exact."""
        out_features, in_features = weight.shape
        layer = cls(in_features, out_features, bits, group_size, bias is not None, device=weight.device)
        if not torch.isfinite(weight).all():
            raise EdgetrainError("cannot quantise a weight that holds NaN or infinite values")
        work = weight.detach().to(torch.float32).reshape(out_features, -1, group_size)
        low = work.amin(dim=-1)
        scale = (work.amax(dim=-1) - low) / (2 ** bits - 1)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round((work - low.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, 2 ** bits - 1).to(torch.uint8)
        q = q.reshape(out_features, in_features)
        layer.codes = q[:, 0::2] | (q[:, 1::2] << 4) if bits == 4 else q.contiguous()
        dtype = weight.dtype if weight.is_floating_point() else torch.float32
        layer.scales, layer.biases = scale.to(dtype), low.to(dtype)
        if bias is not None:
            layer.bias = bias.detach().clone()
        return layer


def is_quantized(module: nn.Module) -> bool:
    """Whether any layer of `module` holds quantised weights."""
    return any(isinstance(m, QuantizedLinear) for m in module.modules())
