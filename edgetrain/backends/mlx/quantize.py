"""4-bit (or 8-bit) affine quantisation of the frozen base linears, group size 64 (MeSP paper, 4.5).

Two ways to compute with a quantised weight, chosen per device:
  "quantized"   mx.quantized_matmul on the packed weight (forward x W^T and backward g W alike): the
                dense weight never exists. Fast on Apple GPUs.
  "dequantize"  dense W = mx.dequantize(...) at each use, ~1M weights at a time, freed after its
                matmul. MLX's CPU
                quantized_matmul is ~50x slower than a BLAS matmul of the same shape (1.26 s vs
                26 ms for 256x896x4864), so on CPU one dequantisation per use is far cheaper.
Memory held between steps is the packed weight either way.
"""
from __future__ import annotations

from typing import Literal

import mlx.core as mx
import mlx.nn as nn

from edgetrain.registry import EdgetrainError
from edgetrain.backends.mlx.evaluation import evaluate

ComputeMode = Literal["quantized", "dequantize"]
DEFAULT_GROUP_SIZE = 64
DEFAULT_BITS = 4
# Weights dequantised per piece in "dequantize" mode (4 MB of fp32).
DEQUANTIZE_PIECE_ELEMENTS = 1 << 20


def default_compute_mode() -> ComputeMode:
    return "quantized" if mx.default_device() == mx.gpu else "dequantize"


class QuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear (same parameters: weight, scales, biases, bias -- the mlx-lm layout) that
    can also compute through a dense dequantised weight (see the module docstring)."""

    compute_mode: ComputeMode = "quantized"

    @property
    def in_features(self) -> int:
        return self.weight.shape[1] * 32 // self.bits

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def dense_weight(self) -> mx.array:
        """The dequantised [out, in] weight (a new lazy array at each call)."""
        return mx.dequantize(self.weight, self.scales, self.biases, group_size=self.group_size, bits=self.bits)

    def _row_pieces(self) -> list[tuple[int, int]]:
        # mx.dequantize peaks at twice its output; dequantising ~1M weights at a time keeps the
        # dense temporaries at a few MB whatever the layer's size (packing runs along the input
        # dimension, so rows of weight/scales/biases slice cleanly).
        rows = self.out_features
        step = max(1, DEQUANTIZE_PIECE_ELEMENTS // self.in_features)
        return [(start, min(start + step, rows)) for start in range(0, rows, step)]

    def _dense_rows(self, start: int, stop: int, dtype: mx.Dtype) -> mx.array:
        return mx.dequantize(self.weight[start:stop], self.scales[start:stop], self.biases[start:stop],
                             group_size=self.group_size, bits=self.bits).astype(dtype)

    def matmul_transposed(self, x: mx.array, eager: bool = False) -> mx.array:
        """x @ W^T without the bias. eager=True evaluates each piece at once (for callers outside
        autodiff that want one dense piece alive at a time; MLX otherwise may dequantise every
        piece of a graph before the first matmul runs)."""
        if self.compute_mode == "quantized":
            return mx.quantized_matmul(x, self.weight, self.scales, self.biases, transpose=True,
                                       group_size=self.group_size, bits=self.bits)
        pieces = []
        for start, stop in self._row_pieces():
            pieces.append(x @ self._dense_rows(start, stop, x.dtype).T)
            if eager:
                evaluate(pieces[-1])
        return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=-1)

    def matmul(self, g: mx.array, eager: bool = False) -> mx.array:
        """g @ W: the input gradient of x @ W^T (eager as in matmul_transposed)."""
        if self.compute_mode == "quantized":
            return mx.quantized_matmul(g, self.weight, self.scales, self.biases, transpose=False,
                                       group_size=self.group_size, bits=self.bits)
        total = None
        for start, stop in self._row_pieces():
            part = g[..., start:stop] @ self._dense_rows(start, stop, g.dtype)
            total = part if total is None else total + part
            if eager:
                evaluate(total)
        return total

    def __call__(self, x: mx.array) -> mx.array:
        y = self.matmul_transposed(x)
        return y + self.bias if "bias" in self else y


def quantize_linear(linear: nn.Linear, group_size: int = DEFAULT_GROUP_SIZE, bits: int = DEFAULT_BITS,
                    compute_mode: ComputeMode | None = None) -> QuantizedLinear:
    out_features, in_features = linear.weight.shape
    if in_features % group_size and in_features % 32 == 0:
        # MLX groups are 32, 64 or 128 wide; a width 64 does not divide (tiny's 352) takes 32.
        group_size = 32
    if in_features % group_size:
        raise EdgetrainError(f"cannot quantise a linear with {in_features} inputs in groups of {group_size}")
    layer = QuantizedLinear(in_features, out_features, bias="bias" in linear, group_size=group_size, bits=bits)
    layer.weight, layer.scales, layer.biases = mx.quantize(linear.weight, group_size=group_size, bits=bits)
    if "bias" in linear:
        layer.bias = linear.bias
    layer.compute_mode = compute_mode or default_compute_mode()
    layer.freeze()
    return layer


BLOCK_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _parent_and_attr(block: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    parent_path, _, attr = dotted.rpartition(".")
    parent = block
    for part in parent_path.split("."):
        parent = getattr(parent, part)
    return parent, attr


def quantize_block(block: nn.Module, group_size: int = DEFAULT_GROUP_SIZE, bits: int = DEFAULT_BITS,
                   compute_mode: ComputeMode | None = None) -> None:
    """Replace the seven projections of one decoder block by QuantizedLinears (in place). A LoRA
    wrapper's base linear is quantised and the adapter kept."""
    for path in BLOCK_LINEARS:
        parent, attr = _parent_and_attr(block, path)
        layer = getattr(parent, attr)
        holder, name = (layer, "linear") if hasattr(layer, "lora_a") else (parent, attr)
        base = getattr(holder, name)
        if isinstance(base, QuantizedLinear):
            continue
        setattr(holder, name, quantize_linear(base, group_size, bits, compute_mode))
    mx.eval(block.parameters())


def quantize_model(model: nn.Module, bits: int = DEFAULT_BITS, group_size: int = DEFAULT_GROUP_SIZE,
                   compute_mode: ComputeMode | None = None) -> nn.Module:
    """Quantise every block's base projections (embedding, norms and LM head stay dense)."""
    if bits not in (2, 3, 4, 6, 8):
        raise EdgetrainError(f"quantisation bits must be one of 2, 3, 4, 6, 8; got {bits!r}")
    for block in model.blocks:
        quantize_block(block, group_size, bits, compute_mode)
    return model


def set_compute_mode(model: nn.Module, mode: ComputeMode) -> None:
    """Switch every QuantizedLinear of `model` to `mode` (see the module docstring)."""
    if mode not in ("quantized", "dequantize"):
        raise EdgetrainError(f"compute mode must be 'quantized' or 'dequantize', got {mode!r}")
    for _, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            module.compute_mode = mode


def packed_matrix_count(model: nn.Module) -> int:
    """How many of the model's matrices are held quantised (MLX QuantizedLinear)."""
    return sum(isinstance(module, QuantizedLinear) for _, module in model.named_modules())
