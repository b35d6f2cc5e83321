"""Remake tests/fixtures/arch: tiny random models of today's architectures, built by transformers' own
config and model classes (offline), saved as checkpoint directories, converted to GGUF by llama.cpp's own
converter (convert_hf_to_gguf.py), with transformers' logits and llama.cpp's on fixed tokens beside them.

    .venv/bin/python tools/make_arch_fixtures.py [--out tests/fixtures/arch] [--llama-cpp-src DIR]

llama.cpp's converter comes from the llama-cpp-python source distribution (`pip download --no-deps
--no-binary :all: llama-cpp-python==0.3.36`, fetched into --cache when --llama-cpp-src is not given; nothing
of it is committed). It refuses a BPE vocabulary whose pre-tokenizer it does not recognise by hash; the
fixtures' small vocabulary is a byte-level BPE of their own, so the converter is told the pre-tokenizer
(`PRE_TOKENIZERS`). llama.cpp's logits need llama-cpp-python (the `llamacpp` extra); without it they are left
out and the tests that read them skip.

Models (ARCHITECTURES): `llama3`, Llama 3.2's shape with its RoPE scaling (rope_type llama3), which llama.cpp
writes as `rope_freqs.weight`; `qwen3`, Qwen3's head norms over q and k with a head size of its own (32, not
hidden / heads = 16) and an untied head, with Qwen's chat template; `gemma3`, sliding layers (window 16, their
own RoPE base) and a global one, sandwich norms, GeGLU, scaled embeddings, with Gemma's turns. Norm weights are drawn away from one, so a norm read wrongly shows.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "arch"
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
TOKENS = 96  # positions whose logits are stored: past Llama 3's original context below (64), where scaling acts
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)


def _llama3() -> Any:
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **COMMON, rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}))


def _qwen3() -> Any:
    import transformers

    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **COMMON, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False))


def _gemma3() -> Any:
    import transformers

    # Window 16 < the 96 stored positions, so the sliding layers' mask acts; scores scaled by head_dim, as llama.cpp
    # scales every Gemma 3 but the 27B (the published 270M and 1B have query_pre_attn_scalar = head_dim too).
    # Seven layers: Gemma's pattern (five sliding, one global) and one more sliding, which llama.cpp assumes
    # when the GGUF names no pattern (its converter writes none).
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 7}, head_dim=32, query_pre_attn_scalar=32, sliding_window=16))


# name -> (the transformers model, built with the vocabulary's size set by the caller; llama.cpp's pre-tokenizer)
ARCHITECTURES: dict[str, Callable[[], Any]] = {"llama3": _llama3, "qwen3": _qwen3, "gemma3": _gemma3}
PRE_TOKENIZERS = {"llama3": "llama-bpe", "qwen3": "qwen2", "gemma3": "llama-bpe"}
# Turn markers a model's template needs that the fixtures' vocabulary lacks: added as special tokens.
TURN_TOKENS = {"gemma3": ["<start_of_turn>", "<end_of_turn>"],
               "llama3": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
# The chat template each model's tokenizer carries (the converter copies it into the GGUF), written in the form
# of the published models' templates with the turn markers the fixtures' vocabulary has. Qwen3's is ChatML;
# with add_generation_prompt it opens the assistant's turn with an empty think block (thinking off).
CHAT_TEMPLATES = {
    "qwen3": ("{%- for message in messages %}"
              "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
              "{%- endfor %}"
              "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' }}{%- endif %}"),
    # Llama 3.x's headers; a turn ends with <|eot_id|> (its published template also opens with the BOS token).
    "llama3": ("{{- bos_token }}{%- for message in messages %}"
               "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
               " + '<|eot_id|>' }}"
               "{%- endfor %}"
               "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"),
    # Gemma's turns: the assistant is "model".
    "gemma3": ("{%- for message in messages %}"
               "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
               "{{- '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
               "{%- endfor %}"
               "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"),
}


def _vocab():
    sys.path.insert(0, str(REPO / "tests"))
    import gguf_testkit

    return gguf_testkit.VOCAB


def save_checkpoint(name: str, directory: Path) -> Any:
    """The model with random weights (seed 0) and the fixtures' byte-level BPE tokenizer, saved as transformers
    saves them."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens, merges, _ = _vocab()
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                     merges=[tuple(m.split(" ")) for m in merges]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|im_start|>",
                                                eos_token="<|im_end|>", pad_token="<|endoftext|>")
    if name in TURN_TOKENS:
        fast.add_special_tokens({"additional_special_tokens": TURN_TOKENS[name]})
    torch.manual_seed(0)
    model = ARCHITECTURES[name]()
    model.resize_token_embeddings(len(fast))
    with torch.no_grad():  # transformers starts norms at one (zero for Gemma's 1 + w): move them off it
        for parameter_name, parameter in model.named_parameters():
            if "norm" in parameter_name:
                parameter.add_(torch.randn(parameter.shape) * 0.3)
    model.eval()
    model.save_pretrained(directory)
    if name in CHAT_TEMPLATES:
        fast.chat_template = CHAT_TEMPLATES[name]
    fast.save_pretrained(directory)
    return model


def llama_cpp_source(cache: Path) -> Path:
    """vendor/llama.cpp of llama-cpp-python's source distribution, fetched through the package index once."""
    found = sorted(cache.glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if found:
        return found[-1].parent
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", LLAMA_CPP_PYTHON,
                    "-d", str(cache), "-q"], check=True)
    archive = next(cache.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name and (
            m.name.endswith(".py") or "/gguf-py/" in m.name)]
        tar.extractall(cache, members=members, filter="data")
    return next(cache.glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py")).parent


def convert(source: Path, checkpoint: Path, out: Path, pre_tokenizer: str) -> None:
    """llama.cpp's convert_hf_to_gguf.py on `checkpoint`, F32, told the pre-tokenizer, in a child process (its
    own gguf-py, not the installed one)."""
    code = (f"import sys, runpy\nsys.path[:0] = [{str(source / 'gguf-py')!r}, {str(source)!r}]\n"
            "import conversion.base as base\n"
            f"base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre_tokenizer!r}\n"
            f"sys.argv = ['convert_hf_to_gguf.py', {str(checkpoint)!r}, '--outfile', {str(out)!r}, '--outtype', 'f32']\n"
            f"runpy.run_path({str(source / 'convert_hf_to_gguf.py')!r}, run_name='__main__')\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)


def fixture_tokens() -> list[int]:
    rng = np.random.default_rng(7)
    return [int(t) for t in rng.integers(0, len(_vocab()[0]), TOKENS)]


def fixture_adapter(gguf_path: Path) -> Any:
    """The fixture's model from its GGUF with a LoRA adapter on every projection (seeded, B drawn large enough
    to move the logits): what the adapter fixtures are written from, and what the tests make again."""
    import torch

    import edgetrain

    model = edgetrain.load_model(gguf_path)
    torch.manual_seed(1)
    edgetrain.add_lora(model, rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("lora_B"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model


def write_fixture_adapter(model: Any, out: Path) -> Path:
    """The adapter as llama.cpp's LoRA GGUF (edgetrain's writer: what llama.cpp's logits with it check)."""
    import tempfile

    import edgetrain
    from edgetrain.adapters.convert import convert_adapter

    with tempfile.TemporaryDirectory() as scratch:
        saved = edgetrain.save_lora(model, Path(scratch) / "adapter.safetensors")
        return convert_adapter(saved, out, "gguf", base_config=model.config)


def llama_cpp_logits(path: Path, ids: list[int], lora: Path | None = None) -> np.ndarray | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    options = {"lora_path": str(lora)} if lora is not None else {}
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=2, seed=0,
                          **options)
    llm.eval(ids)
    logits = np.array(llm.scores[:len(ids)], dtype=np.float32)
    llm.close()
    return logits


# SentencePiece vocabularies (tokenizer.ggml.model "llama", what Gemma and Llama 2 GGUFs carry): a BPE model
# trained here with byte fallback and Gemma's turn markers, in a one-layer model of each kind (llama: a space
# prefixed to each piece of text; gemma3: none), converted by llama.cpp's converter; llama.cpp's ids for TEXTS.
SPM_MODELS = ("llama", "gemma3")
SPM_EXTRA_TEXTS = ["<start_of_turn>user\nHello there<end_of_turn>\n<start_of_turn>model\n", "  two  spaces ",
                   "tabs\tand\nnew lines", "\u2581already escaped \u2581", ""]


def _spm_model(kind: str, vocab_size: int) -> Any:
    import transformers

    small = {**COMMON, "num_hidden_layers": 1, "vocab_size": vocab_size}
    if kind == "gemma3":
        return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**small, head_dim=16,
                                                                          query_pre_attn_scalar=16))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**small))


def make_spm(out: Path, source: Path) -> dict:
    import shutil
    import tempfile

    import sentencepiece
    import torch

    sys.path.insert(0, str(REPO / "tests"))
    import gguf_testkit

    texts = list(gguf_testkit.TEXTS) + SPM_EXTRA_TEXTS
    result: dict[str, Any] = {"texts": texts, "models": {}}
    with tempfile.TemporaryDirectory() as scratch:
        prefix = Path(scratch) / "spm"
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(gguf_testkit.CORPUS * 4 + texts), model_prefix=str(prefix), vocab_size=400,
            model_type="bpe", byte_fallback=True, character_coverage=1.0, minloglevel=2,
            user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], hard_vocab_limit=False)
        processor = sentencepiece.SentencePieceProcessor(model_file=f"{prefix}.model")
        vocab_size = processor.get_piece_size()
        # As Gemma's tokenizer_config.json does: its turn markers are special (the converter makes them control).
        turns = {str(processor.piece_to_id(piece)): {"content": piece, "special": True}
                 for piece in ("<start_of_turn>", "<end_of_turn>")}
        for kind in SPM_MODELS:
            checkpoint = Path(scratch) / kind
            torch.manual_seed(0)
            _spm_model(kind, vocab_size).save_pretrained(checkpoint)
            shutil.copyfile(f"{prefix}.model", checkpoint / "tokenizer.model")
            (checkpoint / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": turns}))
            gguf_path = out / f"spm-{kind}.gguf"
            convert(source, checkpoint, gguf_path, "default")
            ids = llama_cpp_token_ids(gguf_path, texts)
            result["models"][kind] = {"gguf": gguf_path.name, "llama_cpp_ids": ids}
            print(f"spm-{kind}: {gguf_path.name} ({gguf_path.stat().st_size / 1024:.0f} KiB)")
    return result


def llama_cpp_token_ids(path: Path, texts: list[str]) -> list[list[int]] | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, verbose=False, n_threads=2, vocab_only=True)
    ids = [[int(t) for t in llm.tokenize(text.encode(), add_bos=False, special=True)] for text in texts]
    llm.close()
    return ids


def make(out: Path, source: Path) -> dict:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    ids = fixture_tokens()
    manifest: dict[str, Any] = {"tokens": ids, "models": {}}
    logits: dict[str, np.ndarray] = {}
    for name in ARCHITECTURES:
        checkpoint = out / name
        model = save_checkpoint(name, checkpoint)
        gguf_path = out / f"{name}.gguf"
        convert(source, checkpoint, gguf_path, PRE_TOKENIZERS[name])
        with torch.no_grad():
            logits[f"{name}.transformers"] = model(torch.tensor([ids])).logits[0].float().numpy()
        theirs = llama_cpp_logits(gguf_path, ids)
        if theirs is not None:
            logits[f"{name}.llama_cpp"] = theirs
        adapted = fixture_adapter(gguf_path)
        lora_path = write_fixture_adapter(adapted, out / f"{name}.lora.gguf")
        with torch.no_grad():
            logits[f"{name}.edgetrain_lora"] = adapted(torch.tensor([ids]))[0].float().numpy()
        theirs_lora = llama_cpp_logits(gguf_path, ids, lora_path)
        if theirs_lora is not None:
            logits[f"{name}.llama_cpp_lora"] = theirs_lora
        manifest["models"][name] = {"checkpoint": name, "gguf": gguf_path.name, "llama_cpp": theirs is not None,
                                    "lora": lora_path.name}
        print(f"{name}: {checkpoint.name}/ and {gguf_path.name} ({gguf_path.stat().st_size / 1024:.0f} KiB)")
    np.savez_compressed(out / "logits.npz", tokens=np.array(ids, dtype=np.int32), **logits)
    manifest["sentencepiece"] = make_spm(out, source)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=FIXTURES)
    parser.add_argument("--llama-cpp-src", type=Path, default=None, help="llama.cpp's source (vendor/llama.cpp)")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "edgetrain" / "llama-cpp-src")
    args = parser.parse_args()
    make(args.out, args.llama_cpp_src or llama_cpp_source(args.cache))


if __name__ == "__main__":
    main()
