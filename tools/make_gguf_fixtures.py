"""Remake tests/fixtures/gguf: a tiny random llama model quantised by llama.cpp's own quantizer to every
block format edgetrain reads, with llama.cpp's logits on fixed tokens beside each file.

    CMAKE_ARGS="-DGGML_NATIVE=OFF" .venv/bin/pip install 'edgetrain[llamacpp]'   # compiles llama.cpp
    .venv/bin/python tools/make_gguf_fixtures.py [--out tests/fixtures/gguf]

The model's rows are 256 and 512 values wide, multiples of llama.cpp's k-quant super-block (256), so the
quantizer writes the k-quants themselves rather than falling back to Q5_0 / Q8_0 as it does for
SmolLM2's 576-wide rows. llama.cpp chooses each tensor's type within a file type as it does for any
model (a Q4_K_M file holds Q4_K and Q6_K, its output Q6_K): `manifest.json` lists what each file holds.
The default lane reads these files and the stored logits (tests/models/test_gguf_fixtures.py); the slow
lane runs this script's steps again and compares live.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "gguf"
# llama.cpp file types -> the fixture's name (what a user downloads as "Q4_K_M" and so on).
FILE_TYPES = ("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS")
SIZES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
TEXT = ("On-device training keeps the data on the device; the model learns where it runs. "
        "def train(model, data):\n    for batch in data:\n        loss = model(batch)\n")
TOKENS = 40  # positions whose logits are stored


def fixture_tokens() -> list[int]:
    """The fixed token ids the logits are taken at: the test vocabulary's tokens of TEXT."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokens, merges, _ = _vocab()
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                     merges=[tuple(m.split(" ")) for m in merges]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    ids = tokenizer.encode(TEXT).ids[:TOKENS]
    if len(ids) < TOKENS:
        raise SystemExit(f"the fixture text gives {len(ids)} tokens, fewer than {TOKENS}")
    return ids


def _vocab():
    sys.path.insert(0, str(REPO / "tests"))
    import gguf_testkit

    return gguf_testkit.VOCAB


TRAIN_STEPS = 150


def write_f32_model(path: Path, ids: list[int]) -> Path:
    """The tiny llama model, F32, written as convert_hf_to_gguf would (tests/gguf_testkit.write_gguf).

    It is first trained a little on the fixture's own tokens: a random model's top two logits are often
    closer than llama.cpp's rounding of activations to 8 bits moves them, so agreement on the top token
    would measure ties rather than the weights; a model that has learned the text predicts it decisively."""
    import torch
    import transformers

    sys.path.insert(0, str(REPO / "tests"))
    import gguf_testkit

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SIZES, vocab_size=len(gguf_testkit.VOCAB[0]), tie_word_embeddings=False,
                                      initializer_range=0.1, rope_theta=10000.0)
    model = transformers.LlamaForCausalLM(config)
    batch = torch.tensor([ids])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(TRAIN_STEPS):
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"tiny model trained {TRAIN_STEPS} steps on the fixture text: loss {float(loss):.3f}")
    return gguf_testkit.write_gguf(path, model.eval())


def quantize(source: Path, target: Path, file_type: str) -> None:
    """llama.cpp's quantizer (llama_model_quantize), as llama-quantize runs it, on 2 threads."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{file_type}")
    params.nthread = 2
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if status != 0:
        raise SystemExit(f"llama_model_quantize failed for {file_type} (status {status})")


def llama_cpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits at every position of `ids`, float32 [positions, vocab]."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=2, seed=0)
    llm.eval(ids)
    logits = np.array(llm.scores[:len(ids)], dtype=np.float32)
    llm.close()
    return logits


def tensor_types(path: Path) -> dict[str, str]:
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}


def make(out: Path) -> dict:
    """Write every fixture, the stored logits and the manifest into `out`; the manifest."""
    import llama_cpp

    out.mkdir(parents=True, exist_ok=True)
    f32 = out / "tiny-f32.gguf.tmp"
    ids = fixture_tokens()
    write_f32_model(f32, ids)
    logits = {}
    manifest = {"llama_cpp_python": llama_cpp.__version__, "tokens": ids, "files": {}}
    try:
        for file_type in FILE_TYPES:
            target = out / f"tiny-{file_type}.gguf"
            quantize(f32, target, file_type)
            logits[file_type] = llama_cpp_logits(target, ids)
            types = tensor_types(target)
            manifest["files"][file_type] = {"file": target.name, "bytes": target.stat().st_size,
                                            "types": dict(sorted(Counter(types.values()).items())),
                                            "tensors": types}
            print(f"{target.name}: {target.stat().st_size / 1024:.0f} KiB, "
                  + ", ".join(f"{n} x {t}" for t, n in sorted(Counter(types.values()).items())))
    finally:
        f32.unlink(missing_ok=True)
    np.savez_compressed(out / "llama_cpp_logits.npz", tokens=np.array(ids, dtype=np.int32), **logits)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=FIXTURES)
    make(parser.parse_args().out)


if __name__ == "__main__":
    main()
