"""The decoder (Llama, Qwen2, Qwen3, Gemma 3) in MLX, the twin of edgetrain.models.llama: same LlamaConfig, same block
view (embed -> blocks -> head), same submodule names (q_proj, input_layernorm, ...), same numerics
(RMSNorm in fp32, rotate-half RoPE with the torch model's inverse frequencies, causal GQA attention).

Reads top-down: norm -> RoPE -> attention -> MLP -> block -> embedding / head -> model.
"""
from __future__ import annotations

import math
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from edgetrain.models.llama import LlamaConfig, rope_inverse_frequencies


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = mx.ones((dim,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """weight * (x / rms(x)), normalised in fp32 and rounded to x's dtype before the weight (as torch)."""
    x32 = x.astype(mx.float32)
    normed = x32 * mx.rsqrt(mx.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rope_cos_sin(config: LlamaConfig, seq_len: int, dtype: mx.Dtype, local: bool = False) -> tuple[mx.array, mx.array]:
    """cos, sin [T, head_dim] from the torch model's inverse frequencies (llama3 scaling included; `local`:
    the sliding layers' own base, as edgetrain.models.llama.rope_cos_sin)."""
    if local:
        config = replace(config, rope_theta=config.rope_local_base_freq, rope_scaling=None)
    inv_freq = rope_inverse_frequencies(config).numpy().astype(np.float32)
    angles = np.outer(np.arange(seq_len, dtype=np.float32), inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)
    return mx.array(np.cos(angles)).astype(dtype), mx.array(np.sin(angles)).astype(dtype)


def rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    return x * cos + rotate_half(x) * sin


def causal_attention(q: mx.array, k: mx.array, v: mx.array, start: int = 0, window: int | None = None,
                     scale: float | None = None) -> mx.array:
    """softmax(q k^T * scale) v with a causal mask (scale 1/sqrt(hd) unless given; a sliding `window`: each
    query sees itself and the window - 1 keys before it); q [B, H, T, hd], k/v [B, KV, S, hd] shared by
    groups of H/KV query heads (no repeated K/V). The softmax runs in fp32. The queries are positions
    start .. start + T - 1 and the keys 0 .. S - 1 (S = start + T; start > 0: generation's key/value cache)."""
    batch, heads, seq_len, head_dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, seq_len, head_dim)
    scores = (grouped @ k[:, :, None].swapaxes(-1, -2)) * (1.0 / math.sqrt(head_dim) if scale is None else scale)
    keys, queries = mx.arange(k.shape[2])[None, :], mx.arange(start, start + seq_len)[:, None]
    future = keys > queries
    if window is not None:
        future = future | (keys <= queries - window)
    scores = mx.where(future, mx.array(-mx.inf, dtype=scores.dtype), scores)
    probs = mx.softmax(scores.astype(mx.float32), axis=-1).astype(q.dtype)
    return (probs @ v[:, :, None]).reshape(batch, heads, seq_len, head_dim)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        hd, nh, nkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, hd
        self.sliding_window, self.local_rope = config.window_of(layer), config.local_rope(layer)
        scale = config.attention_scale
        self.scale = None if scale == hd ** -0.5 else scale
        self.q_proj = nn.Linear(config.hidden_size, nh * hd, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, nkv * hd, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, nkv * hd, bias=config.attention_bias)
        self.o_proj = nn.Linear(nh * hd, config.hidden_size, bias=False)
        if config.qk_norm:  # Qwen3, Gemma 3: an RMSNorm over each head's query and key before RoPE
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)

    def queries_keys_values(self, x: mx.array, rope: tuple[mx.array, mx.array]) -> tuple[mx.array, ...]:
        """q [B, H, T, hd], k and v [B, KV, T, hd] of x: projected, head-normed where the model has head
        norms, q and k rotated by `rope` (the tables of x's positions)."""
        batch, seq_len, _ = x.shape
        q = self.q_proj(x).reshape(batch, seq_len, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(batch, seq_len, self.num_kv_heads, self.head_dim)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        cos, sin = rope
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q: mx.array, k: mx.array, v: mx.array, start: int = 0) -> mx.array:
        return causal_attention(q, k, v, start, self.sliding_window, self.scale)

    def __call__(self, x: mx.array, rope: tuple[mx.array, mx.array]) -> mx.array:
        batch, seq_len, _ = x.shape
        out = self.attend(*self.queries_keys_values(x, rope))
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, seq_len, -1))


def gelu_tanh(x: mx.array) -> mx.array:
    """torch's gelu(approximate="tanh"): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return 0.5 * x * (1 + mx.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))


ACTIVATIONS = {"silu": nn.silu, "gelu_pytorch_tanh": gelu_tanh}


class GatedMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.activation = config.hidden_activation  # a name: the module must copy and pickle (mx.compile'd silu cannot)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(ACTIVATIONS[self.activation](self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    """As edgetrain.models.llama.DecoderBlock: with sandwich norms (Gemma 3) post_attention_layernorm norms
    the attention's output and pre_feedforward_layernorm is the MLP's input norm."""

    def __init__(self, config: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config)
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def sandwich(self) -> bool:
        return "pre_feedforward_layernorm" in self

    @property
    def mlp_input_norm(self) -> RMSNorm:
        return self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm

    def attention_residual(self, h: mx.array, attended: mx.array) -> mx.array:
        return h + (self.post_attention_layernorm(attended) if self.sandwich else attended)

    def mlp_residual(self, h: mx.array) -> mx.array:
        out = self.mlp(self.mlp_input_norm(h))
        return h + (self.post_feedforward_layernorm(out) if self.sandwich else out)

    def __call__(self, h: mx.array, rope: tuple[mx.array, mx.array]) -> mx.array:
        return self.mlp_residual(self.attention_residual(h, self.self_attn(self.input_layernorm(h), rope)))


class TokenEmbedding(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.scale = math.sqrt(config.hidden_size) if config.scale_embeddings else None  # Gemma's

    def __call__(self, token_ids: mx.array) -> mx.array:
        rows = self.embed_tokens(token_ids)
        return rows if self.scale is None else rows * mx.array(self.scale, dtype=rows.dtype)


class LMHead(nn.Module):
    """Final norm + LM head. With tied embeddings there is no lm_head weight of its own: the head
    reads the embedding matrix it is given (one copy of the largest tensor, as in torch)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class MLXDecoder(nn.Module):
    """Decoder-only LM exposing the block view: embed -> blocks -> head (final norm + LM head)."""

    task = "lm"
    framework = "mlx"  # which backends run it: edgetrain.generate & co. hand it to their text module

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = TokenEmbedding(config)
        self.blocks = [DecoderBlock(config, layer) for layer in range(config.num_hidden_layers)]
        self.head = LMHead(config)

    def lm_head_weight(self) -> mx.array:
        """[vocab, hidden]: the LM head's weight, or the embedding when they are tied."""
        if self.config.tie_word_embeddings:
            return self.embed.embed_tokens.weight
        return self.head.lm_head.weight

    def rope(self, seq_len: int, dtype: mx.Dtype, local: bool = False) -> tuple[mx.array, mx.array]:
        return rope_cos_sin(self.config, seq_len, dtype, local)

    def block_ropes(self, seq_len: int, dtype: mx.Dtype, start: int = 0) -> list[tuple[mx.array, mx.array]]:
        """Each block's RoPE tables for positions start .. seq_len - 1, made once for each kind of block."""
        kinds = {block.self_attn.local_rope for block in self.blocks}
        tables = {local: tuple(t[start:] for t in self.rope(seq_len, dtype, local)) for local in kinds}
        return [tables[block.self_attn.local_rope] for block in self.blocks]

    def logits(self, hidden: mx.array) -> mx.array:
        logits = self.head.norm(hidden) @ self.lm_head_weight().T
        cap = self.config.final_logit_softcapping
        return logits if cap is None else mx.tanh(logits / cap) * cap

    def __call__(self, token_ids: mx.array) -> mx.array:
        h = self.embed(token_ids)
        for block, rope in zip(self.blocks, self.block_ropes(h.shape[1], h.dtype)):
            h = block(h, rope)
        return self.logits(h)


# Hugging Face key -> edgetrain key (applied to prefixes), as edgetrain.models.llama.
HF_PREFIXES = (("model.embed_tokens.", "embed.embed_tokens."), ("model.layers.", "blocks."),
               ("model.norm.", "head.norm."), ("lm_head.", "head.lm_head."))


def hf_key_to_edgetrain(key: str) -> str:
    for hf_prefix, our_prefix in HF_PREFIXES:
        if key.startswith(hf_prefix):
            return our_prefix + key[len(hf_prefix):]
    return key


def edgetrain_key_to_hf(key: str) -> str:
    for hf_prefix, our_prefix in HF_PREFIXES:
        if key.startswith(our_prefix):
            return hf_prefix + key[len(our_prefix):]
    return key
