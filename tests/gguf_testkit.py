"""Writing tiny llama/qwen2 GGUF files the way llama.cpp's convert_hf_to_gguf does, from transformers
models, with the `gguf` package: shared by the GGUF loader, MLX and adapter tests."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
Q = gguf.GGMLQuantizationType

SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def train(model, data):\n    for batch in data:\n        loss = model(batch)\n        loss.backward()\n",
    "On-device training keeps the data on the device; the model learns where it runs.",
    "import numpy as np\nx = np.zeros((3, 4))\nprint(x.shape)  # (3, 4)\n",
    "In 2024 we counted 1234567 tokens over 12345 steps: 2024, 1234567, 12345.",
]
TEXTS = [
    "The lazy dog learns where it runs.",
    "  leading spaces, trailing tabs\t\tand\nnew lines\n\n",
    "for i in range(10):\n    print(i ** 2)  # squares\n",
    "Since 2024: 1234567 tokens, 12345 steps, 20241234567.",
    "Grüße aus Köln: naïve café, déjà vu.",
    "日本語のテキストと中文文本, Ελληνικά, русский текст, עברית",
    "emoji 🤖🚀 and symbols ∑∫√ ≠ ≤",
    "<|im_start|>user\nhello<|im_end|>\n<|endoftext|>",
    "<think>reasoning</think> answer",
]
# Hugging Face parameter names -> llama.cpp tensor names (written independently of edgetrain's map).
HF_TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
HF_BLOCK_TO_GGUF = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                    "mlp.down_proj": "ffn_down"}


# ---------------------------------------------------------------------------------------------------
# Writing GGUF files the way convert_hf_to_gguf does


def _byte_level_vocab() -> tuple[list[str], list[str], list[int]]:
    """A small byte-level BPE vocabulary (256 bytes + learned merges + control tokens + one
    user-defined token): tokens in id order, merges "a b", llama.cpp token types."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tokenizer.to_str())["model"]["merges"]]
    tokens.append("<think>")
    types = [3 if t in SPECIAL else 4 if t == "<think>" else 1 for t in tokens]
    return tokens, merges, types


VOCAB = _byte_level_vocab()


def hf_model(arch: str = "llama", tie: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    # A wide init so attention is far from uniform: a wrong Q/K row order then shows in the logits.
    common = dict(SIZES, vocab_size=len(VOCAB[0]), tie_word_embeddings=tie, initializer_range=0.2)
    if arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, rope_theta=1e6))
        with torch.no_grad():  # transformers zero-inits biases; random ones prove they are loaded
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0, 0.2)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, rope_theta=10000.0))
    return model.eval()


def permute_rows(weights: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: rotate-half RoPE rows -> interleaved pairs."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def gguf_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{HF_BLOCK_TO_GGUF[module]}.{kind}"


def write_gguf(path: Path, hf_model, qtype=Q.F32, tweak=None, pre: str | None = None) -> Path:
    """`hf_model` as a GGUF file; 2-D weights stored as `qtype`, norms and biases as F32.
    `tweak(writer)` may edit metadata (writer.kv_data[0]) or tensors before writing."""
    config = hf_model.config
    arch = config.model_type
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"] if hasattr(config, "rope_parameters")
                              else config.rope_theta)
    writer.add_vocab_size(config.vocab_size)
    if arch == "llama":
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    tokens, merges, types = VOCAB
    writer.add_tokenizer_model("gpt2")
    if pre:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    for hf_name, tensor in hf_model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy()
        if arch == "llama" and ".q_proj." in hf_name:
            data = permute_rows(data, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            data = permute_rows(data, config.num_key_value_heads)
        if data.ndim == 2 and qtype != Q.F32:
            writer.add_tensor(gguf_name(hf_name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(hf_name), data)
    if tweak:
        tweak(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
