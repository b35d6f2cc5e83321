"""One decoder block's forward and structured backward on MLX, from its stored input alone -- the
walk of edgetrain.methods.mesp.block on torch:

  attention half (recomputed once, kept):  q, k, v after RoPE, attention output o, h1 = x + o_proj(o)
  MLP half, `mlp_chunk` tokens at a time:  norm -> gate/up -> SiLU*up -> down, recomputed and
                                           differentiated per chunk (position-wise, so its
                                           [T, intermediate] tensors never exist for all T)
  attention backward, query chunks:        o_proj -> attention -> RoPE^-1 -> q/k/v -> input norm

MLX is lazy: mx.eval at the chunk and phase boundaries is what bounds the live set (an unevaluated
array keeps its whole graph alive). LoRA's x @ A is recomputed where its gradient needs it unless
`store_lora_projection` keeps the one the recomputed forward produced (the paper's Table 5).
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from edgetrain.backends.mlx.lora import LoRALinear
from edgetrain.backends.mlx.methods.mesp_ops import (LinearWeights, causal_attention_backward,
                                                     causal_attention_forward, linear_group_backward,
                                                     linear_group_forward, linear_group_input_grad,
                                                     lora_group_backward, rms_norm_backward, rms_norm_forward,
                                                     rope_backward, rope_forward, GATED_ACTIVATIONS)
from edgetrain.backends.mlx.model import DecoderBlock
from edgetrain.backends.mlx.quantize import QuantizedLinear
from edgetrain.models.lora import LORA_TARGETS
from edgetrain.registry import EdgetrainError
from edgetrain.backends.mlx.evaluation import evaluate

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


def _module_at(block: nn.Module, dotted: str) -> nn.Module:
    module = block
    for part in dotted.split("."):
        module = getattr(module, part)
    return module


def linear_weights(module: nn.Module, where: str) -> LinearWeights:
    if isinstance(module, LoRALinear):
        if module.dropout:
            raise EdgetrainError(f"{where}: LoRA dropout ({module.dropout}) is not supported by mesp, whose "
                                 "recomputed forward could not replay the dropout mask; use dropout=0")
        return LinearWeights(module.linear, module.lora_a, module.lora_b, module.scale)
    if isinstance(module, (nn.Linear, QuantizedLinear)):
        return LinearWeights(module)
    raise EdgetrainError(f"{where} is a {type(module).__name__}; mesp handles Linear, QuantizedLinear, LoRALinear")


@dataclass
class BlockWeights:
    input_norm: mx.array
    post_attention_norm: mx.array
    eps: float
    linears: dict[str, LinearWeights]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_norm: mx.array | None = None  # Qwen3's head norms over q and k before RoPE; None where there are none
    k_norm: mx.array | None = None
    # The rest as edgetrain.methods.mesp.block.BlockWeights (Gemma 3's features); post_attention_norm is the
    # MLP's input norm.
    attention_output_norm: mx.array | None = None
    mlp_output_norm: mx.array | None = None
    activation: str = "silu"
    sliding_window: int | None = None
    attention_scale: float | None = None

    @classmethod
    def from_block(cls, block: nn.Module, where: str = "block") -> "BlockWeights":
        if not isinstance(block, DecoderBlock):
            raise EdgetrainError(f"{where} is a {type(block).__name__}, not an MLX DecoderBlock")
        attn = block.self_attn
        head_norms = [attn[name] if name in attn else None for name in ("q_norm", "k_norm")]
        output_norms = ([block.post_attention_layernorm, block.post_feedforward_layernorm] if block.sandwich
                        else [None, None])
        norms = [block.input_layernorm, block.mlp_input_norm, *(n for n in head_norms + output_norms if n is not None)]
        if len({norm.eps for norm in norms}) > 1:
            raise EdgetrainError(f"{where}: its RMSNorms use different eps")
        linears = {name: linear_weights(_module_at(block, LORA_TARGETS[name]), f"{where}.{LORA_TARGETS[name]}")
                   for name in PROJECTIONS}
        q_norm, k_norm, attention_output_norm, mlp_output_norm = (
            None if n is None else n.weight for n in head_norms + output_norms)
        return cls(norms[0].weight, norms[1].weight, float(norms[0].eps), linears,
                   attn.num_heads, attn.num_kv_heads, attn.head_dim, q_norm, k_norm, attention_output_norm,
                   mlp_output_norm, block.mlp.activation, attn.sliding_window, attn.scale)


def _check_chunk(name: str, value: int) -> None:
    if not (isinstance(value, int) and value >= 1):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _attention_half(weights: BlockWeights, flat_x: mx.array, batch: int, seq_len: int,
                    rope: tuple[mx.array, mx.array], attention_chunk: int) -> tuple:
    """x -> (q, k, v after RoPE, attention o [B, H, T, hd], o as [N, H*hd], h1 = x + o_proj(o), the
    LoRA projections of q/k/v and of o, q and k before their head norms [B, T, H, hd] or None)."""
    lin = weights.linears
    heads, kv_heads, head_dim = weights.num_heads, weights.num_kv_heads, weights.head_dim
    cos, sin = rope
    normed = rms_norm_forward(flat_x, weights.input_norm, weights.eps)
    (q, k, v), qkv_projection = linear_group_forward(normed, [lin["q"], lin["k"], lin["v"]])
    q, k = q.reshape(batch, seq_len, heads, head_dim), k.reshape(batch, seq_len, kv_heads, head_dim)
    q_raw = k_raw = None
    if weights.q_norm is not None:  # the norms' backward reads their inputs: q and k as projected
        q_raw, k_raw = q, k
        q = rms_norm_forward(q, weights.q_norm, weights.eps)
        k = rms_norm_forward(k, weights.k_norm, weights.eps)
    q = rope_forward(q.transpose(0, 2, 1, 3), cos, sin)
    k = rope_forward(k.transpose(0, 2, 1, 3), cos, sin)
    v = v.reshape(batch, seq_len, kv_heads, head_dim).transpose(0, 2, 1, 3)
    attention = causal_attention_forward(q, k, v, attention_chunk, weights.sliding_window, weights.attention_scale)
    attention_flat = attention.transpose(0, 2, 1, 3).reshape(batch * seq_len, heads * head_dim)
    (o,), o_projection = linear_group_forward(attention_flat, [lin["o"]])
    o_out = None
    if weights.attention_output_norm is not None:  # its backward reads its input: the o projection, kept
        o_out, o = o, rms_norm_forward(o, weights.attention_output_norm, weights.eps)
    return q, k, v, attention, attention_flat, flat_x + o, qkv_projection, o_projection, q_raw, k_raw, o_out


def _mlp_forward(weights: BlockWeights, h1_chunk: mx.array) -> mx.array:
    lin = weights.linears
    normed = rms_norm_forward(h1_chunk, weights.post_attention_norm, weights.eps)
    (gate, up), _ = linear_group_forward(normed, [lin["gate"], lin["up"]])
    (down,), _ = linear_group_forward(GATED_ACTIVATIONS[weights.activation][0](gate, up), [lin["down"]])
    if weights.mlp_output_norm is not None:
        down = rms_norm_forward(down, weights.mlp_output_norm, weights.eps)
    return h1_chunk + down


def block_forward(weights: BlockWeights, x: mx.array, rope: tuple[mx.array, mx.array], *,
                  attention_chunk: int, mlp_chunk: int) -> mx.array:
    """The block's output for x [B, T, D] (equal to DecoderBlock), with the backward's bounded temporaries."""
    _check_chunk("attention_chunk", attention_chunk)
    _check_chunk("mlp_chunk", mlp_chunk)
    batch, seq_len, dim = x.shape
    h1 = _attention_half(weights, x.reshape(batch * seq_len, dim), batch, seq_len, rope, attention_chunk)[5]
    evaluate(h1)
    outputs = []
    for start in range(0, h1.shape[0], mlp_chunk):
        outputs.append(_mlp_forward(weights, h1[start:start + mlp_chunk]))
        evaluate(outputs[-1])
    out = mx.concatenate(outputs, axis=0) if len(outputs) > 1 else outputs[0]
    return out.reshape(batch, seq_len, dim)


def block_backward(weights: BlockWeights, x: mx.array, grad_out: mx.array, rope: tuple[mx.array, mx.array], *,
                   attention_chunk: int, mlp_chunk: int, store_lora_projection: bool = False
                   ) -> tuple[mx.array, dict[str, mx.array]]:
    """(dL/dx shaped like x, {block-relative name "self_attn.q_proj.lora_a": gradient}) given the
    block input x [B, T, D] and dL/d(output). Everything returned is evaluated."""
    _check_chunk("attention_chunk", attention_chunk)
    _check_chunk("mlp_chunk", mlp_chunk)
    if grad_out.shape != x.shape:
        raise ValueError(f"grad_out {tuple(grad_out.shape)} does not match the block input {tuple(x.shape)}")
    batch, seq_len, dim = x.shape
    heads, kv_heads, head_dim = weights.num_heads, weights.num_kv_heads, weights.head_dim
    cos, sin = rope
    lin = weights.linears
    grads: dict[str, list[mx.array]] = {}

    def collect(names: tuple[str, ...], pairs: list) -> None:
        for name, pair in zip(names, pairs):
            if pair is not None:
                path = LORA_TARGETS[name]
                grads.setdefault(f"{path}.lora_a", []).append(pair[0])
                grads.setdefault(f"{path}.lora_b", []).append(pair[1])

    def evaluated_sums() -> list[mx.array]:
        # Chunk contributions summed as soon as they exist, so no chunk's pieces outlive it.
        for name, parts in grads.items():
            grads[name] = [parts[0] if len(parts) == 1 else sum(parts[1:], parts[0])]
        return [parts[0] for parts in grads.values()]

    flat_x = x.reshape(batch * seq_len, dim)
    flat_grad = grad_out.reshape(batch * seq_len, dim)
    q, k, v, attention, attention_flat, h1, qkv_projection, o_projection, q_raw, k_raw, o_out = _attention_half(
        weights, flat_x, batch, seq_len, rope, attention_chunk)
    if not store_lora_projection:
        qkv_projection = o_projection = None
    evaluate(q, k, v, attention, attention_flat, h1,
             *[p for p in (qkv_projection, o_projection, q_raw, k_raw, o_out) if p is not None])
    activation_forward, activation_backward = GATED_ACTIVATIONS[weights.activation]

    grad_h1_chunks = []
    for start in range(0, h1.shape[0], mlp_chunk):
        h1_chunk, grad_chunk = h1[start:start + mlp_chunk], flat_grad[start:start + mlp_chunk]
        normed = rms_norm_forward(h1_chunk, weights.post_attention_norm, weights.eps)
        (gate, up), gate_up_projection = linear_group_forward(normed, [lin["gate"], lin["up"]])
        activation = activation_forward(gate, up)
        grad_down = grad_chunk
        if weights.mlp_output_norm is not None:  # down's output is recomputed: its norm's backward reads it
            (down,), _ = linear_group_forward(activation, [lin["down"]])
            grad_down = rms_norm_backward(down, weights.mlp_output_norm, weights.eps, grad_chunk)
        down_grad_projection, down_grads = lora_group_backward(activation, [lin["down"]], [grad_down])
        collect(("down",), down_grads)
        grad_activation = linear_group_input_grad([lin["down"]], [grad_down], down_grad_projection)
        grad_gate, grad_up = activation_backward(gate, up, grad_activation)
        grad_normed, gate_up_grads = linear_group_backward(
            normed, [lin["gate"], lin["up"]], [grad_gate, grad_up],
            projection=gate_up_projection if store_lora_projection else None)
        collect(("gate", "up"), gate_up_grads)
        grad_h1_chunks.append(grad_chunk + rms_norm_backward(h1_chunk, weights.post_attention_norm,
                                                             weights.eps, grad_normed))
        evaluate(grad_h1_chunks[-1], *evaluated_sums())
    del h1
    grad_h1 = mx.concatenate(grad_h1_chunks, axis=0) if len(grad_h1_chunks) > 1 else grad_h1_chunks[0]

    grad_o = grad_h1
    if o_out is not None:
        grad_o = rms_norm_backward(o_out, weights.attention_output_norm, weights.eps, grad_h1)
    grad_attention_flat, o_grads = linear_group_backward(attention_flat, [lin["o"]], [grad_o], projection=o_projection)
    collect(("o",), o_grads)
    evaluate(grad_attention_flat, *evaluated_sums())
    del attention_flat, o_projection
    grad_attention = grad_attention_flat.reshape(batch, seq_len, heads, head_dim).transpose(0, 2, 1, 3)
    grad_q, grad_k, grad_v = causal_attention_backward(q, k, v, attention, grad_attention, attention_chunk,
                                                       weights.sliding_window, weights.attention_scale)
    del q, k, v, attention, grad_attention, grad_attention_flat
    grad_q = rope_backward(grad_q, cos, sin).transpose(0, 2, 1, 3)
    grad_k = rope_backward(grad_k, cos, sin).transpose(0, 2, 1, 3)
    if weights.q_norm is not None:
        grad_q = rms_norm_backward(q_raw, weights.q_norm, weights.eps, grad_q)
        grad_k = rms_norm_backward(k_raw, weights.k_norm, weights.eps, grad_k)
    del q_raw, k_raw
    grad_q = grad_q.reshape(batch * seq_len, heads * head_dim)
    grad_k = grad_k.reshape(batch * seq_len, kv_heads * head_dim)
    grad_v = grad_v.transpose(0, 2, 1, 3).reshape(batch * seq_len, kv_heads * head_dim)
    # The input norm's output is recomputed (one cheap pass over x) rather than held through the MLP.
    normed = rms_norm_forward(flat_x, weights.input_norm, weights.eps)
    grad_normed, qkv_grads = linear_group_backward(normed, [lin["q"], lin["k"], lin["v"]],
                                                   [grad_q, grad_k, grad_v], projection=qkv_projection)
    collect(("q", "k", "v"), qkv_grads)
    grad_x = grad_h1 + rms_norm_backward(flat_x, weights.input_norm, weights.eps, grad_normed)
    sums = evaluated_sums()
    evaluate(grad_x, *sums)
    # Torch's order (q, k, v, o, gate, up, down), A before B.
    ordered = {f"{LORA_TARGETS[name]}.{part}": grads[f"{LORA_TARGETS[name]}.{part}"][0]
               for name in PROJECTIONS for part in ("lora_a", "lora_b") if f"{LORA_TARGETS[name]}.{part}" in grads}
    return grad_x.reshape(batch, seq_len, dim), ordered
