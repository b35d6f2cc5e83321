"""Hand-derived forward and backward passes of a decoder block's pieces on MLX (MeSP paper, Appendix A),
the same math as edgetrain.methods.mesp.ops on torch.

No autodiff: plain array functions, so the caller decides which arrays live and when they are
evaluated. Every backward recomputes what it needs from its inputs (RMSNorm's 1/rms, the attention
probabilities, SiLU's sigmoid, LoRA's x @ A) instead of relying on anything stored by the forward.
LoRA is in mlx-lm's layout: y = x W^T + b + s (x A) B with A [in, r], B [r, out].

RMSNorm and the attention softmax run in fp32, everything else in the input dtype, as the model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn

from edgetrain.backends.mlx.model import rms_norm as rms_norm_forward  # noqa: F401 -- mesp.py imports it from here
from edgetrain.backends.mlx.model import gelu_tanh, rotate_half
from edgetrain.backends.mlx.quantize import QuantizedLinear
from edgetrain.backends.mlx.evaluation import evaluate


def compute_dtype(dtype: mx.Dtype) -> mx.Dtype:
    """fp32 for half-precision inputs (softmax and reductions lose too much in bf16), else unchanged."""
    return mx.float32 if dtype in (mx.float16, mx.bfloat16) else dtype


# -- RMSNorm ---------------------------------------------------------------------------------------

def rms_norm_backward(x: mx.array, weight: mx.array, eps: float, grad_out: mx.array) -> mx.array:
    """dL/dx of rms_norm_forward (the weight is frozen). With r = 1/rms(x), n = x r, g = weight dL/dy:
    dx = r (g - n mean(g n))."""
    x32 = x.astype(mx.float32)
    inv_rms = mx.rsqrt(mx.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    grad_normed = (grad_out * weight).astype(mx.float32)
    normed = x32 * inv_rms
    projection = mx.mean(grad_normed * normed, axis=-1, keepdims=True)
    return ((grad_normed - normed * projection) * inv_rms).astype(x.dtype)


# -- RoPE ------------------------------------------------------------------------------------------

def rope_forward(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    return x * cos + rotate_half(x) * sin


def rope_backward(grad_out: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """RoPE is a rotation per position, so its backward is the rotation by -theta."""
    return grad_out * cos - rotate_half(grad_out) * sin


# -- grouped-query causal attention ----------------------------------------------------------------

def _grouped(x: mx.array, kv_heads: int) -> mx.array:
    """[B, H, T, hd] -> [B, KV, G, T, hd]: the G query heads that share a KV head side by side."""
    batch, heads, seq_len, head_dim = x.shape
    return x.reshape(batch, kv_heads, heads // kv_heads, seq_len, head_dim)


def _causal_probabilities(q_chunk: mx.array, keys: mx.array, start: int, scale: float,
                          window: int | None = None) -> mx.array:
    """softmax(q k^T s) under the causal mask (and a sliding `window`) for query rows start:start+C against
    keys 0:stop. q_chunk [B, KV, G, C, hd], keys [B, KV, 1, stop, hd] -> [B, KV, G, C, stop], fp32."""
    scores = (q_chunk @ keys.swapaxes(-1, -2)) * scale
    rows, stop = scores.shape[-2], scores.shape[-1]
    queries = (mx.arange(rows) + start)[:, None]
    future = mx.arange(stop)[None, :] > queries
    if window is not None:
        future = future | (mx.arange(stop)[None, :] <= queries - window)
    scores = mx.where(future, mx.array(-mx.inf, dtype=scores.dtype), scores)
    return mx.softmax(scores, axis=-1)


def causal_attention_forward(q: mx.array, k: mx.array, v: mx.array, chunk: int, window: int | None = None,
                             scale: float | None = None) -> mx.array:
    """Causal softmax attention, q [B, H, T, hd], k/v [B, KV, T, hd]; query rows `chunk` at a time
    against the keys they can see, so the largest temporary is [B, H, chunk, T]. Returns [B, H, T, hd]."""
    batch, heads, seq_len, head_dim = q.shape
    kv_heads = k.shape[1]
    work = compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    grouped_q = _grouped(q, kv_heads).astype(work)
    keys, values = k[:, :, None].astype(work), v[:, :, None].astype(work)
    outputs = []
    for start in range(0, seq_len, chunk):
        stop = min(start + chunk, seq_len)
        probs = _causal_probabilities(grouped_q[:, :, :, start:stop], keys[:, :, :, :stop], start, scale, window)
        outputs.append(probs @ values[:, :, :, :stop])
    out = mx.concatenate(outputs, axis=3) if len(outputs) > 1 else outputs[0]
    return out.reshape(batch, heads, seq_len, head_dim).astype(q.dtype)


def causal_attention_backward(q: mx.array, k: mx.array, v: mx.array, out: mx.array, grad_out: mx.array,
                              chunk: int, window: int | None = None, scale: float | None = None
                              ) -> tuple[mx.array, mx.array, mx.array]:
    """dL/dq, dL/dk, dL/dv of causal_attention_forward given its output and dL/d(out). Per query
    chunk P is recomputed (Appendix A.2):
      dV += P^T dO,  dS = P (dO V^T - rowsum(dO O)) s,  dQ = dS K,  dK += dS^T Q
    (rowsum(dO O) = rowsum(P dP), the softmax correction, without a [C, T] temporary)."""
    batch, heads, seq_len, head_dim = q.shape
    kv_heads = k.shape[1]
    work = compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    grouped_q = _grouped(q, kv_heads).astype(work)
    grouped_out = _grouped(out, kv_heads).astype(work)
    grouped_grad = _grouped(grad_out, kv_heads).astype(work)
    keys, values = k[:, :, None].astype(work), v[:, :, None].astype(work)
    grad_k = mx.zeros(k.shape, dtype=work)
    grad_v = mx.zeros(v.shape, dtype=work)
    grad_q_chunks = []
    for start in range(0, seq_len, chunk):
        stop = min(start + chunk, seq_len)
        q_chunk = grouped_q[:, :, :, start:stop]
        grad_chunk = grouped_grad[:, :, :, start:stop]
        correction = mx.sum(grad_chunk * grouped_out[:, :, :, start:stop], axis=-1, keepdims=True)
        probs = _causal_probabilities(q_chunk, keys[:, :, :, :stop], start, scale, window)
        grad_v = grad_v.at[:, :, :stop].add(mx.sum(probs.swapaxes(-1, -2) @ grad_chunk, axis=2))
        grad_scores = probs * ((grad_chunk @ values[:, :, :, :stop].swapaxes(-1, -2)) - correction) * scale
        grad_q_chunks.append(grad_scores @ keys[:, :, :, :stop])
        grad_k = grad_k.at[:, :, :stop].add(mx.sum(grad_scores.swapaxes(-1, -2) @ q_chunk, axis=2))
        # One chunk's [B, H, C, T] temporaries at a time.
        evaluate(grad_q_chunks[-1], grad_k, grad_v)
    grad_q = mx.concatenate(grad_q_chunks, axis=3) if len(grad_q_chunks) > 1 else grad_q_chunks[0]
    return (grad_q.reshape(batch, heads, seq_len, head_dim).astype(q.dtype), grad_k.astype(k.dtype),
            grad_v.astype(v.dtype))


# -- SwiGLU ----------------------------------------------------------------------------------------

def swiglu_forward(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


def swiglu_backward(gate: mx.array, up: mx.array, grad_out: mx.array) -> tuple[mx.array, mx.array]:
    """dL/dgate, dL/dup of silu(gate) * up (Appendix A.4): d_up = g silu(gate),
    d_gate = g up silu'(gate), silu' = sig + silu (1 - sig)."""
    sig = mx.sigmoid(gate)
    silu = gate * sig
    return grad_out * up * (sig + silu * (1 - sig)), grad_out * silu


def geglu_forward(gate: mx.array, up: mx.array) -> mx.array:
    return gelu_tanh(gate) * up


def geglu_backward(gate: mx.array, up: mx.array, grad_out: mx.array) -> tuple[mx.array, mx.array]:
    """dL/dgate, dL/dup of gelu_tanh(gate) * up: with u = c (x + a x^3), t = tanh(u),
    gelu' = (1 + t) / 2 + x (1 - t^2) c (1 + 3 a x^2) / 2."""
    c, a = math.sqrt(2 / math.pi), 0.044715
    t = mx.tanh(c * (gate + a * gate * gate * gate))
    derivative = 0.5 * (1 + t) + 0.5 * gate * (1 - t * t) * c * (1 + 3 * a * gate * gate)
    return grad_out * up * derivative, grad_out * (0.5 * gate * (1 + t))


# The gated MLP's activation by LlamaConfig.hidden_activation: (forward, backward).
GATED_ACTIVATIONS = {"silu": (swiglu_forward, swiglu_backward), "gelu_pytorch_tanh": (geglu_forward, geglu_backward)}


# -- linear layers with optional LoRA ------------------------------------------------------------------

@dataclass
class LinearWeights:
    """A frozen linear (nn.Linear or a 4-bit QuantizedLinear) plus its LoRA adapter when present."""

    base: nn.Module
    lora_a: mx.array | None = None  # [in, r]
    lora_b: mx.array | None = None  # [r, out]
    scale: float = 1.0

    @property
    def has_lora(self) -> bool:
        return self.lora_a is not None

    @property
    def rank(self) -> int:
        return 0 if self.lora_a is None else self.lora_a.shape[1]

    @property
    def bias(self) -> mx.array | None:
        return self.base.bias if "bias" in self.base else None

    def matmul_transposed(self, x: mx.array) -> mx.array:
        """x W^T (no bias). A quantised weight is dequantised at this use only, a piece at a time
        and evaluated at once (or multiplied packed, see edgetrain.backends.mlx.quantize), so at
        most one piece of one dense weight is alive."""
        if isinstance(self.base, QuantizedLinear):
            return self.base.matmul_transposed(x, eager=True)
        return x @ self.base.weight.T

    def matmul(self, g: mx.array) -> mx.array:
        """g W: the input gradient of x W^T."""
        if isinstance(self.base, QuantizedLinear):
            return self.base.matmul(g, eager=True)
        return g @ self.base.weight


def lora_projection(x: mx.array, linears: Sequence[LinearWeights]) -> mx.array | None:
    """x @ [A_1 A_2 ...] for the adapted linears sharing the input x: one matmul, [N, sum of ranks]."""
    adapters = [lin.lora_a for lin in linears if lin.has_lora]
    if not adapters:
        return None
    return x @ (adapters[0] if len(adapters) == 1 else mx.concatenate(adapters, axis=1))


def linear_group_forward(x: mx.array, linears: Sequence[LinearWeights]) -> tuple[list[mx.array], mx.array | None]:
    """Outputs of linears reading the same 2-D input x [N, in], and the fused LoRA projection."""
    projection = lora_projection(x, linears)
    outputs, offset = [], 0
    for lin in linears:
        y = lin.matmul_transposed(x)
        if lin.bias is not None:
            y = y + lin.bias
        if lin.has_lora:
            y = y + (projection[:, offset:offset + lin.rank] @ lin.lora_b) * lin.scale
            offset += lin.rank
        outputs.append(y)
    return outputs, projection


def lora_group_backward(x: mx.array, linears: Sequence[LinearWeights], grad_outputs: Sequence[mx.array],
                        projection: mx.array | None = None
                        ) -> tuple[mx.array | None, list[tuple[mx.array, mx.array] | None]]:
    """The LoRA half of linear_group_backward (Appendix A.1). With u = x A (recomputed from x unless
    the caller kept it) and g = dL/dy:  dB = s u^T g,  dA = x^T (s g B^T).

    Returns (s g B^T for all adapters side by side [N, sum of ranks] -- all that the input gradient
    needs besides the weights --, [(dA, dB) or None per linear])."""
    adapted = [i for i, lin in enumerate(linears) if lin.has_lora]
    grads: list[tuple[mx.array, mx.array] | None] = [None] * len(linears)
    if not adapted:
        return None, grads
    if projection is None:
        projection = lora_projection(x, linears)
    pieces = [(grad_outputs[i] @ linears[i].lora_b.T) * linears[i].scale for i in adapted]
    grad_projection = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=1)
    grad_a_stacked = x.T @ grad_projection
    offset = 0
    for i in adapted:
        lin = linears[i]
        u = projection[:, offset:offset + lin.rank]
        grads[i] = (grad_a_stacked[:, offset:offset + lin.rank], (u.T @ grad_outputs[i]) * lin.scale)
        offset += lin.rank
    return grad_projection, grads


def linear_group_input_grad(linears: Sequence[LinearWeights], grad_outputs: Sequence[mx.array],
                            grad_projection: mx.array | None) -> mx.array:
    """dL/dx = sum g W + (s g B^T) A^T for linears sharing the input x."""
    grad_x = linears[0].matmul(grad_outputs[0])
    for lin, grad in zip(linears[1:], grad_outputs[1:]):
        grad_x = grad_x + lin.matmul(grad)
    if grad_projection is not None:
        adapters = [lin.lora_a for lin in linears if lin.has_lora]
        stacked = adapters[0] if len(adapters) == 1 else mx.concatenate(adapters, axis=1)
        grad_x = grad_x + grad_projection @ stacked.T
    return grad_x


def linear_group_backward(x: mx.array, linears: Sequence[LinearWeights], grad_outputs: Sequence[mx.array],
                          projection: mx.array | None = None
                          ) -> tuple[mx.array, list[tuple[mx.array, mx.array] | None]]:
    """(dL/dx, per-linear (dA, dB) or None) of linear_group_forward."""
    grad_projection, grads = lora_group_backward(x, linears, grad_outputs, projection)
    return linear_group_input_grad(linears, grad_outputs, grad_projection), grads
