"""One decoder block's forward and structured backward, from its stored input alone.

The backward re-runs the block's forward to regenerate what it needs, then walks it in reverse,
releasing each intermediate as soon as its last reader is done:

  attention half (recomputed once, kept):  q, k, v after RoPE, attention output o, h1 = x + o_proj(o)
  MLP half, `mlp_chunk` tokens at a time:  norm -> gate/up -> SiLU*up -> down, recomputed and
                                           differentiated per chunk (the MLP is position-wise, so
                                           its [T, intermediate] tensors never exist for all T)
  attention backward, query chunks:        o_proj -> attention -> RoPE^-1 -> q/k/v -> input norm

Any subset of the seven projections may carry LoRA; the frozen rest are plain linears. The LoRA
projections x @ A^T are recomputed where their gradient needs them (the MeSP insight) unless
`store_lora_projection` keeps the ones the recomputed forward produced (the paper's Table 5).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
from torch import nn

from edgetrain.methods.mesp.ops import (GATED_ACTIVATIONS, LinearWeights, LoRAGradients, causal_attention_backward,
                                        causal_attention_forward, compute_dtype, linear_group_backward,
                                        linear_group_forward, linear_group_input_grad, lora_group_backward,
                                        rms_norm_backward, rms_norm_forward,
                                        rope_backward, rope_forward)
from edgetrain.methods.mesp.step_buffers import fresh_allocations, release_free
from edgetrain.models.llama import DecoderBlock, LlamaConfig, rope_cos_sin
from edgetrain.models.lora import LORA_TARGETS, LoRALinear
from edgetrain.models.quantized import QuantizedLinear
from edgetrain.registry import EdgetrainError

# Projection names in the order the block uses them; module paths come from LORA_TARGETS.
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


def linear_weights(module: nn.Module, where: str) -> LinearWeights:
    """Detached weights of a frozen nn.Linear or a LoRALinear (the adapter included)."""
    if isinstance(module, LoRALinear):
        if module.merged:
            raise EdgetrainError(f"{where}: the LoRA adapter is merged into its base weight; "
                                 "call edgetrain.unmerge_lora(model) before training it")
        if module.dropout and module.training:
            raise EdgetrainError(f"{where}: LoRA dropout ({module.dropout}) is not supported by mesp, whose "
                                 "recomputed forward could not replay the dropout mask; use dropout=0")
        base = module.base
        return replace(_frozen_weights(base, where), lora_A=module.lora_A.detach(), lora_B=module.lora_B.detach(),
                       scale=float(module.scale))
    return _frozen_weights(module, where)


def _frozen_weights(module: nn.Module, where: str) -> LinearWeights:
    if isinstance(module, QuantizedLinear):  # dequantised when used, one layer at a time
        return LinearWeights(None, None if module.bias is None else module.bias.detach(), packed=module)
    if type(module) is nn.Linear:
        return LinearWeights(module.weight.detach(), None if module.bias is None else module.bias.detach())
    raise EdgetrainError(f"{where} is a {type(module).__name__}; mesp handles nn.Linear, QuantizedLinear and "
                         "LoRALinear")


@dataclass
class BlockWeights:
    """Everything a DecoderBlock computes with, as plain tensors (views of its parameters).

    post_attention_norm is the MLP's input norm (Llama's post_attention_layernorm, Gemma's
    pre_feedforward_layernorm); the optional fields are the features of edgetrain.models.llama's decoder
    that Llama lacks, None or off where the model has none."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    eps: float
    linears: dict[str, LinearWeights]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # RMSNorm weights over each head's query and key before RoPE (Qwen3); None where the model has none.
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    # Sandwich norms (Gemma 3): over the attention's output and over the MLP's output.
    attention_output_norm: torch.Tensor | None = None
    mlp_output_norm: torch.Tensor | None = None
    activation: str = "silu"  # the gated MLP's (ops.GATED_ACTIVATIONS)
    sliding_window: int | None = None
    local_rope: bool = False  # rotates with the sliding layers' own RoPE tables (rope_tables(local=True))
    attention_scale: float | None = None  # None: 1 / sqrt(head_dim)

    @classmethod
    def from_block(cls, block: nn.Module, where: str = "block") -> "BlockWeights":
        if not isinstance(block, DecoderBlock):
            raise EdgetrainError(f"{where} is a {type(block).__name__}, not a DecoderBlock")
        config: LlamaConfig = block.self_attn.config
        attn = block.self_attn
        head_norms = [getattr(attn, name, None) for name in ("q_norm", "k_norm")]
        sandwich = config.sandwich_norms
        output_norms = [block.post_attention_layernorm, block.post_feedforward_layernorm] if sandwich else [None, None]
        norms = [block.input_layernorm, block.mlp_input_norm,
                 *(n for n in head_norms + output_norms if n is not None)]
        if len({norm.eps for norm in norms}) > 1:
            raise EdgetrainError(f"{where}: its RMSNorms use different eps")
        linears = {name: linear_weights(block.get_submodule(LORA_TARGETS[name]), f"{where}.{LORA_TARGETS[name]}")
                   for name in PROJECTIONS}
        q_norm, k_norm, attention_output_norm, mlp_output_norm = (
            None if n is None else n.weight.detach() for n in head_norms + output_norms)
        scale = config.attention_scale
        return cls(norms[0].weight.detach(), norms[1].weight.detach(), float(norms[0].eps), linears,
                   config.num_attention_heads, config.num_key_value_heads, config.head_dim, q_norm, k_norm,
                   attention_output_norm, mlp_output_norm, config.hidden_activation, attn.sliding_window,
                   attn.local_rope, None if scale == config.head_dim ** -0.5 else scale)

    def lora_parameter_names(self) -> list[str]:
        """Block-relative names of the adapter parameters, as block.named_parameters() spells them."""
        return [f"{LORA_TARGETS[name]}.{part}" for name in PROJECTIONS if self.linears[name].has_lora
                for part in ("lora_A", "lora_B")]


def rope_tables(config: LlamaConfig, seq_len: int, device: torch.device,
                dtype: torch.dtype, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] exactly as the model's attention computes them (`local`: a sliding layer's own)."""
    return rope_cos_sin(config, seq_len, device, dtype, local=local)


def rope_tables_by_block(config: LlamaConfig, weights: list[BlockWeights], seq_len: int, device: torch.device,
                         dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each block's RoPE tables, made once for each kind of block (global, sliding with its own base)."""
    tables = {local: rope_tables(config, seq_len, device, dtype, local) for local in {w.local_rope for w in weights}}
    return [tables[w.local_rope] for w in weights]


def _check_chunk(name: str, value: int) -> None:
    if not (isinstance(value, int) and value >= 1):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _attention_half(weights: BlockWeights, flat_x: torch.Tensor, batch: int, seq_len: int,
                    rope: tuple[torch.Tensor, torch.Tensor], attention_chunk: int, kept_output: bool = False
                    ) -> tuple[torch.Tensor, ...]:
    """x -> (q, k, v after RoPE, attention output o [B, H, T, hd], its [B*T, H*hd] view,
    h1 = x + o_proj(o) flat, the LoRA projections of q/k/v and o, and q, k before their head norms
    [B, T, H, hd], None without head norms). kept_output: h1 becomes the block's output, stored for the
    backward, so it is not one of the step's reused buffers (step_buffers.py)."""
    lin = weights.linears
    heads, kv_heads, head_dim = weights.num_heads, weights.num_kv_heads, weights.head_dim
    normed = rms_norm_forward(flat_x, weights.input_norm, weights.eps)
    (q, k, v), qkv_projection = linear_group_forward(normed, [lin["q"], lin["k"], lin["v"]])
    del normed
    q, k = q.view(batch, seq_len, heads, head_dim), k.view(batch, seq_len, kv_heads, head_dim)
    # With head norms, their backward reads their inputs: q and k as projected, kept.
    q_raw, k_raw = (q, k) if weights.q_norm is not None else (None, None)
    q, k = _head_norms_and_rope(weights, q, k, rope)
    v = v.view(batch, seq_len, kv_heads, head_dim).transpose(1, 2)
    attention = causal_attention_forward(q, k, v, attention_chunk, weights.sliding_window, weights.attention_scale)
    attention_flat = attention.transpose(1, 2).reshape(batch * seq_len, heads * head_dim)
    o_out = None
    with fresh_allocations() if kept_output and not torch.compiler.is_compiling() else nullcontext():
        (h1,), o_projection = linear_group_forward(attention_flat, [lin["o"]])
        if weights.attention_output_norm is not None:  # its backward reads its input: the o projection, kept
            o_out, h1 = h1, rms_norm_forward(h1, weights.attention_output_norm, weights.eps)
    h1.add_(flat_x)
    return q, k, v, attention, attention_flat, h1, qkv_projection, o_projection, q_raw, k_raw, o_out


def _head_norms_and_rope(weights: BlockWeights, q: torch.Tensor, k: torch.Tensor,
                         rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, H, hd] and k as projected -> q, k [B, H, T, hd] as attention reads them: the head norms
    (where the model has them), then RoPE."""
    cos, sin = rope
    if weights.q_norm is not None:
        q = rms_norm_forward(q, weights.q_norm, weights.eps)
        k = rms_norm_forward(k, weights.k_norm, weights.eps)
    return rope_forward(q.transpose(1, 2), cos, sin), rope_forward(k.transpose(1, 2), cos, sin)


def block_forward(weights: BlockWeights, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], *,
                  attention_chunk: int, mlp_chunk: int) -> torch.Tensor:
    """The block's output for input x [B, T, D], equal to DecoderBlock.forward, computed with the
    same bounded temporaries as the backward (query-chunked attention, token-chunked MLP)."""
    _check_chunk("attention_chunk", attention_chunk)
    _check_chunk("mlp_chunk", mlp_chunk)
    batch, seq_len, dim = x.shape
    flat_x = x.reshape(batch * seq_len, dim)
    h1 = _attention_half(weights, flat_x, batch, seq_len, rope, attention_chunk, kept_output=True)[5]
    lin = weights.linears
    for start in range(0, h1.shape[0], mlp_chunk):
        h1_chunk = h1[start:start + mlp_chunk]
        normed = rms_norm_forward(h1_chunk, weights.post_attention_norm, weights.eps)
        (gate, up), _ = linear_group_forward(normed, [lin["gate"], lin["up"]])
        del normed
        activation = GATED_ACTIVATIONS[weights.activation][0](gate, up, overwrite_inputs=True)
        del gate, up
        (down,), _ = linear_group_forward(activation, [lin["down"]])
        del activation
        if weights.mlp_output_norm is not None:
            down = rms_norm_forward(down, weights.mlp_output_norm, weights.eps)
        h1_chunk.add_(down)  # h1 becomes the block output in place: its rows are read only here
    return h1.view(batch, seq_len, dim)


def block_backward(weights: BlockWeights, x: torch.Tensor, grad_out: torch.Tensor,
                   rope: tuple[torch.Tensor, torch.Tensor], *, attention_chunk: int, mlp_chunk: int,
                   store_lora_projection: bool = False, overwrite_grad_out: bool = False
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """dL/dx and the LoRA gradients of the block, given its input x [B, T, D] and dL/d(output).

    Returns (dL/dx shaped like x, {block-relative parameter name: gradient}) with gradients in the
    parameters' dtype (accumulated in fp32 for half-precision models). overwrite_grad_out=True
    reuses grad_out's buffer for dL/dx (one [B, T, D] buffer less; grad_out is then consumed).
    """
    _check_chunk("attention_chunk", attention_chunk)
    _check_chunk("mlp_chunk", mlp_chunk)
    if grad_out.shape != x.shape:
        raise ValueError(f"grad_out {tuple(grad_out.shape)} does not match the block input {tuple(x.shape)}")
    batch, seq_len, dim = x.shape
    heads, kv_heads, head_dim = weights.num_heads, weights.num_kv_heads, weights.head_dim
    cos, sin = rope
    lin = weights.linears
    accumulators: dict[str, LoRAGradients] = {}

    def acc(name: str) -> LoRAGradients | None:
        # Created on first use, so that a projection's gradient buffers do not exist before its
        # backward begins (the attention adapters' are not alive during the MLP's peak).
        if not lin[name].has_lora:
            return None
        if name not in accumulators:
            accumulators[name] = LoRAGradients.zeros_like(lin[name], compute_dtype(lin[name].lora_A.dtype))
        return accumulators[name]

    flat_x = x.reshape(batch * seq_len, dim)
    # The residual stream's gradient: dL/d(output), then dL/dh1, then dL/dx, all in one buffer.
    flat_grad = grad_out.reshape(batch * seq_len, dim)
    if not overwrite_grad_out:  # (a copy too many where reshape already copied: only for a strided grad_out)
        flat_grad = flat_grad.clone()

    q, k, v, attention, attention_flat, h1, qkv_projection, o_projection, q_raw, k_raw, o_out = _attention_half(
        weights, flat_x, batch, seq_len, rope, attention_chunk)
    activation_forward, activation_backward = GATED_ACTIVATIONS[weights.activation]
    if not store_lora_projection:
        qkv_projection = o_projection = None
    if q_raw is not None:  # q and k as projected are kept instead; the normed, rotated ones come back below
        del q, k

    for start in range(0, h1.shape[0], mlp_chunk):
        h1_chunk, grad_chunk = h1[start:start + mlp_chunk], flat_grad[start:start + mlp_chunk]
        normed = rms_norm_forward(h1_chunk, weights.post_attention_norm, weights.eps)
        (gate, up), gate_up_projection = linear_group_forward(normed, [lin["gate"], lin["up"]])
        if not store_lora_projection:
            gate_up_projection = None
        activation = activation_forward(gate, up)
        grad_down = grad_chunk
        if weights.mlp_output_norm is not None:  # down's output is recomputed: its norm's backward reads it
            (down,), _ = linear_group_forward(activation, [lin["down"]])
            grad_down = rms_norm_backward(down, weights.mlp_output_norm, weights.eps, grad_chunk)
            del down
        # Otherwise down's output is never needed, only its input: its projection is computed once either way.
        # Its LoRA gradients come first so that the activation is freed before dL/dactivation exists.
        down_grad_projection = lora_group_backward(activation, [lin["down"]], [grad_down], [acc("down")])
        del activation
        grad_activation = linear_group_input_grad([lin["down"]], [grad_down], down_grad_projection)
        del down_grad_projection, grad_down
        # Consumes gate, up and grad_activation: three [chunk, intermediate] buffers in, two out.
        grad_gate, grad_up = activation_backward(gate, up, grad_activation, overwrite_inputs=True)
        del gate, up, grad_activation
        grad_normed = linear_group_backward(normed, [lin["gate"], lin["up"]], [grad_gate, grad_up],
                                            [acc("gate"), acc("up")], projection=gate_up_projection)
        del grad_gate, grad_up, gate_up_projection
        grad_chunk.add_(rms_norm_backward(h1_chunk, weights.post_attention_norm, weights.eps, grad_normed))
        del normed, grad_normed
    del h1
    # The MLP's [tokens, intermediate] buffers are free now; the attention's backward needs other shapes, and
    # held through its peak they would add to it (step_buffers.py), except as far as the block inputs already
    # freed make room for them: those are kept for the next block's MLP, which then faults in no fresh pages.
    release_free(within_room=True)

    grad_o = flat_grad
    if o_out is not None:
        grad_o = rms_norm_backward(o_out, weights.attention_output_norm, weights.eps, flat_grad)
    del o_out
    grad_attention_flat = linear_group_backward(attention_flat, [lin["o"]], [grad_o], [acc("o")],
                                                projection=o_projection)
    del attention_flat, o_projection, grad_o
    grad_attention = grad_attention_flat.view(batch, seq_len, heads, head_dim).transpose(1, 2)
    if q_raw is not None:
        q, k = _head_norms_and_rope(weights, q_raw, k_raw, rope)
    grad_q, grad_k, grad_v = causal_attention_backward(q, k, v, attention, grad_attention, attention_chunk,
                                                       weights.sliding_window, weights.attention_scale)
    del q, k, v, attention, grad_attention, grad_attention_flat
    grad_q = rope_backward(grad_q, cos, sin).transpose(1, 2)
    grad_k = rope_backward(grad_k, cos, sin).transpose(1, 2)
    if weights.q_norm is not None:
        grad_q = rms_norm_backward(q_raw, weights.q_norm, weights.eps, grad_q)
        grad_k = rms_norm_backward(k_raw, weights.k_norm, weights.eps, grad_k)
    del q_raw, k_raw
    grad_q = grad_q.reshape(batch * seq_len, heads * head_dim)
    grad_k = grad_k.reshape(batch * seq_len, kv_heads * head_dim)
    grad_v = grad_v.transpose(1, 2).reshape(batch * seq_len, kv_heads * head_dim)
    # The input norm's output is recomputed (one cheap pass over x) rather than held through the MLP.
    normed = rms_norm_forward(flat_x, weights.input_norm, weights.eps)
    grad_normed = linear_group_backward(normed, [lin["q"], lin["k"], lin["v"]], [grad_q, grad_k, grad_v],
                                        [acc("q"), acc("k"), acc("v")], projection=qkv_projection)
    del normed, grad_q, grad_k, grad_v, qkv_projection
    flat_grad.add_(rms_norm_backward(flat_x, weights.input_norm, weights.eps, grad_normed))

    grads: dict[str, torch.Tensor] = {}
    for name in PROJECTIONS:
        if name not in accumulators:
            continue
        accumulator, path = accumulators[name], LORA_TARGETS[name]
        grads[f"{path}.lora_A"] = accumulator.lora_A.to(lin[name].lora_A.dtype)
        grads[f"{path}.lora_B"] = accumulator.lora_B.to(lin[name].lora_B.dtype)
    return flat_grad.view(batch, seq_len, dim), grads
