"""Llama / Qwen2 decoder: token embedding, pre-norm RMSNorm blocks with RoPE grouped-query attention
and a SwiGLU MLP, final norm, LM head (optionally tied to the embedding).

Submodule names follow the Hugging Face checkpoints (q_proj, input_layernorm, ...) so that loading is a
key rename, and the block view (embed / blocks / head) is what every training method walks.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from edgetrain.models.decoder_registry import DecoderArchitecture, register_decoder
from edgetrain.registry import EdgetrainError
from edgetrain.training.precision import compute_dtype

# Sizes beyond these are not a decoder any device in scope could hold; a config past them is damaged.
_MAX_DIM = 1 << 17
_MAX_VOCAB = 1 << 22
_MAX_LAYERS = 1024


class ConfigError(EdgetrainError, ValueError):
    """A model config (config.json or preset) whose values cannot describe a working model."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_llama3_scaling(scaling: dict[str, Any], check: Any) -> None:
    """Llama 3.1 scaling needs `factor`; its other fields have defaults but, when given, must make sense
    (rope_inverse_frequencies divides by factor and by high_freq_factor - low_freq_factor)."""
    def field_ok(name: str, default: Any, integer: bool = False) -> bool:
        value = scaling.get(name, default)
        return _is_number(value) and value > 0 and (not integer or float(value).is_integer())

    check("rope_scaling", "factor" in scaling and field_ok("factor", None), "llama3 needs a finite factor > 0")
    for name, default in (("low_freq_factor", 1.0), ("high_freq_factor", 4.0)):
        check("rope_scaling", field_ok(name, default), f"llama3 {name} must be a finite number > 0")
    check("rope_scaling", scaling.get("high_freq_factor", 4.0) > scaling.get("low_freq_factor", 1.0),
          "llama3 high_freq_factor must exceed low_freq_factor")
    check("rope_scaling", field_ok("original_max_position_embeddings", 8192, integer=True),
          "llama3 original_max_position_embeddings must be a positive integer")


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False  # q/k/v bias (always on in Qwen2)
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    qk_norm: bool = False  # an RMSNorm over each head's query and key before RoPE (Qwen3, Gemma 3)
    # The features below are Gemma 3's (edgetrain/models/gemma3.py); their defaults are Llama's.
    hidden_activation: str = "silu"  # the gated MLP's activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    # RMSNorms on the attention's and the MLP's outputs too; pre_feedforward_layernorm is then the MLP's input norm.
    sandwich_norms: bool = False
    scale_embeddings: bool = False  # token embeddings times sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # attention scores times its -1/2 power (default head_dim's)
    layer_types: list[str] | None = None  # per layer "full_attention" or "sliding_attention"; None: all full
    sliding_window: int | None = None  # keys a sliding layer's query sees: itself and the window - 1 before it
    rope_local_base_freq: float | None = None  # sliding layers' own RoPE base (unscaled); None: the global RoPE
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    model_type: str = "llama"

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // max(self.num_attention_heads, 1)
        self.validate()

    @property
    def kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types is not None and self.layer_types[layer] == "sliding_attention"

    def window_of(self, layer: int) -> int | None:
        """The layer's sliding window, or None for a layer that sees every earlier position."""
        return self.sliding_window if self.is_sliding(layer) else None

    def local_rope(self, layer: int) -> bool:
        """Whether the layer rotates with the sliding layers' own RoPE base rather than the global RoPE."""
        return self.is_sliding(layer) and self.rope_local_base_freq is not None

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def validate(self) -> None:
        def check(name: str, ok: bool, why: str) -> None:
            if not ok:
                raise ConfigError(f"config field {name!r} = {getattr(self, name)!r}: {why}")

        for name, bound in [("vocab_size", _MAX_VOCAB), ("hidden_size", _MAX_DIM),
                            ("intermediate_size", _MAX_DIM * 8), ("num_hidden_layers", _MAX_LAYERS),
                            ("num_attention_heads", _MAX_DIM), ("num_key_value_heads", _MAX_DIM),
                            ("max_position_embeddings", 1 << 24), ("head_dim", _MAX_DIM)]:
            value = getattr(self, name)
            check(name, isinstance(value, int) and not isinstance(value, bool),
                  "must be an integer")
            check(name, 0 < value <= bound, f"must be in 1..{bound}")
        check("num_key_value_heads", self.num_attention_heads % self.num_key_value_heads == 0,
              f"must divide num_attention_heads ({self.num_attention_heads})")
        check("head_dim", self.head_dim % 2 == 0, "must be even for RoPE")
        check("rms_norm_eps", _is_number(self.rms_norm_eps) and 0 < self.rms_norm_eps < 1, "must be in (0, 1)")
        check("rope_theta", _is_number(self.rope_theta) and 1 < self.rope_theta < math.inf, "must be a finite number > 1")
        # A JSON string "false" is truthy: a flag must be a real boolean, or the model is silently wrong.
        for name in ("attention_bias", "mlp_bias", "tie_word_embeddings", "qk_norm", "sandwich_norms",
                     "scale_embeddings"):
            check(name, isinstance(getattr(self, name), bool), "must be true or false")
        check("hidden_activation", self.hidden_activation in ACTIVATIONS,
              f"must be one of {', '.join(ACTIVATIONS)}")
        for name in ("query_pre_attn_scalar", "rope_local_base_freq", "final_logit_softcapping"):
            value = getattr(self, name)
            check(name, value is None or (_is_number(value) and 0 < value < 1e12), "must be a finite number > 0")
        self._validate_layer_types(check)
        check("model_type", isinstance(self.model_type, str), "must be a string")
        if self.rope_scaling is not None:
            check("rope_scaling", isinstance(self.rope_scaling, dict), "must be an object or null")
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            check("rope_scaling", kind in ("llama3", "linear", "default"),
                  "only rope_type 'llama3' or 'linear' (or 'default') is supported")
            if kind == "llama3":
                _check_llama3_scaling(self.rope_scaling, check)
            if kind == "linear":
                factor = self.rope_scaling.get("factor")
                check("rope_scaling", _is_number(factor) and factor > 0, "linear needs a finite factor > 0")

    def _validate_layer_types(self, check: Any) -> None:
        types = self.layer_types
        if types is None:
            return
        check("layer_types", isinstance(types, list) and len(types) == self.num_hidden_layers,
              f"must list one type for each of the {self.num_hidden_layers} layers")
        check("layer_types", all(t in ("full_attention", "sliding_attention") for t in types),
              "each must be 'full_attention' or 'sliding_attention'")
        if "sliding_attention" in types:
            window = self.sliding_window
            check("sliding_window", isinstance(window, int) and not isinstance(window, bool) and 0 < window < 1 << 24,
                  "sliding layers need a window: a positive integer")

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "LlamaConfig":
        """Build from a Hugging Face config.json dict, ignoring keys this model does not use. (An
        architecture's fixed features come on top in edgetrain.models.decoders.config_from_hf_dict.)"""
        return cls.from_values(cls.hf_values(raw))

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> "LlamaConfig":
        try:
            return cls(**values)
        except TypeError as exc:  # e.g. a string where a number belongs
            raise ConfigError(f"config.json has a field of the wrong type: {exc}") from None

    @classmethod
    def hf_values(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """The fields of a Hugging Face config.json dict this config has, checked and normalised."""
        if not isinstance(raw, dict):
            raise ConfigError("config.json must hold a JSON object")
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in known and v is not None}
        rope_params = raw.get("rope_parameters")
        if isinstance(rope_params, dict):  # newer transformers nest theta and scaling here
            values.setdefault("rope_theta", rope_params.get("rope_theta", cls.rope_theta))
            if rope_params.get("rope_type", "default") != "default":
                values.setdefault("rope_scaling", rope_params)
        if "rope_scaling" in values and not isinstance(values["rope_scaling"], dict):
            raise ConfigError(f"config.json rope_scaling must be an object or null, "
                              f"got {type(values['rope_scaling']).__name__}")
        scaling = values.get("rope_scaling", {})
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            values.pop("rope_scaling", None)
        for name in ("rms_norm_eps", "rope_theta"):
            if name in values and isinstance(values[name], int) and not isinstance(values[name], bool):
                values[name] = float(values[name]) if abs(values[name]) < 2 ** 1000 else math.inf
        missing = [n for n in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if n not in values]
        if missing:
            raise ConfigError(f"config.json lacks required field(s): {', '.join(missing)}")
        values.setdefault("num_key_value_heads", values["num_attention_heads"])
        return values


def rope_inverse_frequencies(config: LlamaConfig, device: torch.device | None = None) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))
    scaling = config.rope_scaling
    if scaling and scaling.get("rope_type", scaling.get("type")) == "linear":  # positions divided by factor
        inv_freq = inv_freq / float(scaling["factor"])
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        # Llama 3.1 long-context scaling: low frequencies slowed by `factor`, high kept, smooth in between.
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_context = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq.float()


def rope_cos_sin(config: LlamaConfig, seq_len: int, device: torch.device,
                 dtype: torch.dtype, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, head_dim] (halves repeated, as in rotate_half RoPE); `local`: the sliding
    layers' own unscaled RoPE base (config.rope_local_base_freq)."""
    if local:
        config = replace(config, rope_theta=config.rope_local_base_freq, rope_scaling=None)
    inv_freq = rope_inverse_frequencies(config, device)
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as the reference implementations do, so bf16 models match them; an fp64
        # model normalises in fp64 (edgetrain.training.precision), so that it is a true fp64 reference.
        work = x.to(compute_dtype(x.dtype, self.weight.dtype))
        normed = work * torch.rsqrt(work.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        self.config = config
        self.sliding_window = config.window_of(layer)
        self.local_rope = config.local_rope(layer)
        hd, nh, nkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, nh * hd, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, nkv * hd, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, nkv * hd, bias=config.attention_bias)
        self.o_proj = nn.Linear(nh * hd, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)

    def queries_keys_values(self, x: torch.Tensor, start: int = 0) -> tuple[torch.Tensor, ...]:
        """q [B, H, T, hd], k and v [B, KV, T, hd] of x, the positions start .. start + T - 1: projected,
        head-normed where the model has head norms, q and k rotated."""
        cfg = self.config
        batch, seq_len, _ = x.shape
        q = self.q_proj(x).view(batch, seq_len, cfg.num_attention_heads, cfg.head_dim)
        k = self.k_proj(x).view(batch, seq_len, cfg.num_key_value_heads, cfg.head_dim)
        v = self.v_proj(x).view(batch, seq_len, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        cos, sin = rope_cos_sin(cfg, start + seq_len, x.device, q.dtype, local=self.local_rope)
        return apply_rope(q, cos[start:], sin[start:]), apply_rope(k, cos[start:], sin[start:]), v

    def visible(self, start: int, steps: int, keys: int, device: torch.device) -> torch.Tensor:
        """Which keys 0 .. keys - 1 the queries at positions start .. start + steps - 1 see: [steps, keys]."""
        query = torch.arange(start, start + steps, device=device)[:, None]
        key = torch.arange(keys, device=device)[None, :]
        seen = key <= query
        if self.sliding_window is not None:
            seen &= key > query - self.sliding_window
        return seen

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               visible: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(q k^T * scale) v over the visible keys (default: causal, within the sliding window)."""
        steps, keys = q.shape[2], k.shape[2]
        if visible is None and (self.sliding_window is not None and keys > self.sliding_window or steps != keys):
            visible = self.visible(keys - steps, steps, keys, q.device)
        # The fused CPU kernel has no forward-mode derivative; forward-gradient methods (fgd)
        # push dual tensors through here, so they get the composite math kernel instead.
        kernel = sdpa_kernel(SDPBackend.MATH) if _carries_tangent(q, k, v) else nullcontext()
        with kernel:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, is_causal=visible is None,
                                                  scale=self.config.attention_scale,
                                                  enable_gqa=self.config.kv_groups > 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        out = self.attend(*self.queries_keys_values(x))
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))


def _carries_tangent(*tensors: torch.Tensor) -> bool:
    return any(fwAD.unpack_dual(t).tangent is not None for t in tensors)


# The gated MLP's activations by config.hidden_activation: SwiGLU's and GeGLU's (Gemma's tanh GELU).
def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": gelu_tanh}


class GatedMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.activation = config.hidden_activation  # a name, so that the module pickles
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ACTIVATIONS[self.activation](self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    """Pre-norm attention and MLP with residuals; with sandwich norms (Gemma 3) each output is normed too:
    post_attention_layernorm then norms the attention's output and pre_feedforward_layernorm is the MLP's
    input norm (transformers' names for both layouts)."""

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
    def mlp_input_norm(self) -> RMSNorm:
        return getattr(self, "pre_feedforward_layernorm", self.post_attention_layernorm)

    def attention_residual(self, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """h plus the attention's output (normed, with sandwich norms)."""
        if hasattr(self, "pre_feedforward_layernorm"):
            attended = self.post_attention_layernorm(attended)
        return h + attended

    def mlp_residual(self, h: torch.Tensor) -> torch.Tensor:
        out = self.mlp(self.mlp_input_norm(h))
        if hasattr(self, "post_feedforward_layernorm"):
            out = self.post_feedforward_layernorm(out)
        return h + out

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.mlp_residual(self.attention_residual(h, self.self_attn(self.input_layernorm(h))))


class TokenEmbedding(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # Gemma scales by sqrt(hidden) rounded to the embedding's dtype (a float32 number here).
        self.scale = math.sqrt(config.hidden_size) if config.scale_embeddings else None

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        rows = self.embed_tokens(token_ids)
        return rows if self.scale is None else rows * torch.tensor(self.scale, dtype=rows.dtype)


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    return logits if cap is None else torch.tanh(logits / cap) * cap


class LMHead(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.soft_cap = config.final_logit_softcapping

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return soft_cap(self.lm_head(self.norm(h)), self.soft_cap)


class LlamaModel(nn.Module):
    """Decoder-only LM exposing the block view: embed -> blocks -> head (final norm + LM head)."""

    task = "lm"

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = TokenEmbedding(config)
        self.blocks = nn.ModuleList(DecoderBlock(config, layer) for layer in range(config.num_hidden_layers))
        self.head = LMHead(config)
        if config.tie_word_embeddings:
            self.head.lm_head.weight = self.embed.embed_tokens.weight

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(token_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, seed: int | None = 0) -> None:
        """Random init as the reference models do (normal(0, std) linears/embeddings, unit norms)."""
        generator = torch.Generator(device="cpu")
        if seed is not None:
            generator.manual_seed(seed)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)


# Hugging Face key -> edgetrain key (applied to prefixes).
_HF_PREFIXES = [("model.embed_tokens.", "embed.embed_tokens."), ("model.layers.", "blocks."),
                ("model.norm.", "head.norm."), ("lm_head.", "head.lm_head.")]
# Keys some checkpoints carry that hold nothing a forward needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_key_to_edgetrain(key: str) -> str | None:
    """Map a checkpoint tensor name to this model's parameter name; None for ignorable keys."""
    if key.endswith(_IGNORED_SUFFIXES):
        return None
    for hf_prefix, our_prefix in _HF_PREFIXES:
        if key.startswith(hf_prefix):
            return our_prefix + key[len(hf_prefix):]
    return key


def edgetrain_key_to_hf(key: str) -> str:
    for hf_prefix, our_prefix in _HF_PREFIXES:
        if key.startswith(our_prefix):
            return hf_prefix + key[len(our_prefix):]
    return key


LLAMA = register_decoder(DecoderArchitecture("llama", LlamaConfig, "LlamaForCausalLM", gguf_permutes_qk=True))
# Qwen2 always has q/k/v biases; its config.json does not say so.
QWEN2 = register_decoder(DecoderArchitecture("qwen2", LlamaConfig, "Qwen2ForCausalLM", fixed={"attention_bias": True}))
