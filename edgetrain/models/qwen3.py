"""Qwen3 (dense): the Llama decoder with an RMSNorm over each head's query and key before RoPE, no q/k/v
bias, and a head size of its own (128 at every published size, whatever hidden / heads is).

The decoder itself is edgetrain.models.llama's: `qk_norm` switches the two norms on there, in the MeSP
block and on MLX alike. Checkpoints name them `self_attn.q_norm` / `self_attn.k_norm`, GGUF files
`blk.N.attn_q_norm` / `blk.N.attn_k_norm` (llama.cpp does not reorder Qwen3's Q/K rows).
"""
from __future__ import annotations

from dataclasses import dataclass

from edgetrain.models.decoder_registry import DecoderArchitecture, register_decoder
from edgetrain.models.llama import LlamaConfig


@dataclass
class Qwen3Config(LlamaConfig):
    head_dim: int | None = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    qk_norm: bool = True
    model_type: str = "qwen3"


QWEN3 = register_decoder(DecoderArchitecture("qwen3", Qwen3Config, "Qwen3ForCausalLM", fixed={"qk_norm": True}))
