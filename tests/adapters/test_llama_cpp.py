"""llama.cpp itself (through llama-cpp-python) runs what edgetrain exports for it: a LoRA GGUF on the real
SmolLM2-135M Q4_1 file, and merged GGUFs. Slow: llama-cpp-python compiles llama.cpp from its sdist (about
7 minutes here; pip caches the wheel): pip install 'edgetrain[llamacpp]', then pytest -m slow.

llama.cpp multiplies Q4_1 weights with activations it rounds to 8 bits, so its logits differ from
edgetrain's (the same weights dequantised, fp32 activations) by a few percent of the largest logit, with or
without an adapter (the "quantisation tolerance" below is that measured base difference). What shows that
the adapter is read as written is then: the same difference with the adapter as without, the same change
of logits (adapter minus base) in both runtimes, and the same greedy continuation, which the adapter
changes.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import edgetrain
from edgetrain.adapters.convert import convert_adapter
from edgetrain.export.merged import save_merged_gguf
from edgetrain.models.generate import generate_ids
from edgetrain.models.lora import lora_layers

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install "
                                                     "'edgetrain[llamacpp]'; it compiles llama.cpp, ~7 min)")
pytestmark = pytest.mark.slow

PROMPT = ("<|im_start|>user\nWhat is the capital of France, and what is it famous for?<|im_end|>\n"
          "<|im_start|>assistant\nThe capital of France is")
NEW_TOKENS = 12


def _llama(model_path, lora_path=None):
    options = dict(model_path=str(model_path), n_ctx=256, logits_all=True, verbose=False, n_threads=2, seed=0)
    if lora_path is not None:
        options["lora_path"] = str(lora_path)
    return llama_cpp.Llama(**options)


def _llama_cpp_run(model_path, lora_path=None):
    """(prompt ids, logits at every prompt position, greedy continuation ids) from llama.cpp."""
    llm = _llama(model_path, lora_path)
    ids = llm.tokenize(PROMPT.encode(), add_bos=False, special=True)
    llm.eval(ids)
    logits = np.array(llm.scores[:len(ids)], dtype=np.float64)
    continuation = []
    for token in llm.generate(ids, temp=0.0, reset=True):
        continuation.append(int(token))
        if len(continuation) == NEW_TOKENS:
            break
    return ids, logits, continuation


def _ours(model, ids, adapter_on=True):
    scales = {name: layer.scale for name, layer in lora_layers(model).items()}
    try:
        if not adapter_on:
            for layer in lora_layers(model).values():
                layer.scale = 0.0
        with torch.no_grad():
            logits = model(torch.tensor([ids]))[0].double().numpy()
        return logits, generate_ids(model, ids, NEW_TOKENS)
    finally:
        for name, layer in lora_layers(model).items():
            layer.scale = scales[name]


def _relative(got, expected):
    return float(np.abs(got - expected).max() / np.abs(expected).max())


def _cosine(a, b):
    a, b = a.ravel(), b.ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _adapted(smollm2_file, targets, std, seed=1, dequantize=False):
    torch.manual_seed(seed)  # A's init
    model = edgetrain.load_model(smollm2_file, options=edgetrain.LoadOptions(dequantize=dequantize))
    edgetrain.add_lora(model, rank=8, alpha=16.0, targets=targets)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    return model


# Measured on SmolLM2-135M Q4_1 with llama-cpp-python 0.3.36 (CPU, 2 threads), logits at all 33 prompt
# positions: |llama.cpp - edgetrain| / max 3.0e-2 .. 4.2e-2 with or without an adapter; change-of-logits
# cosine 0.99 (every module, std 0.08) and 0.77 (q and k alone, std 0.05); with the B rows of q/k left
# unpermuted (the mistake these tests are for) 0.90 and 0.16, and the adapter's difference 1.3e-1.
# Greedy continuations: llama.cpp and edgetrain chose the same 12 tokens for "The capital of France is"
# alone, but over this longer prompt they part where two candidates are within the rounding of
# llama.cpp's 8-bit activations, so each of llama.cpp's choices is checked against edgetrain's logits
# after the same prefix instead of token equality.
QUANTISATION_TOLERANCE = 0.06


def _agrees_under_quantisation(model, ids, continuation):
    """Each token llama.cpp chose greedily is edgetrain's argmax after the same prefix, or within the
    quantisation tolerance of it (two logits that close may order either way in the two runtimes)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + continuation]))[0].double()
    for step, token in enumerate(continuation):
        row = logits[len(ids) + step - 1]
        if row.max() - row[token] > QUANTISATION_TOLERANCE * row.abs().max():
            return False
    return True


@pytest.mark.parametrize("targets, std, min_cosine", [(("q", "k", "v", "o", "gate", "up", "down"), 0.08, 0.95),
                                                     (("q", "k"), 0.05, 0.6)])
def test_llama_cpp_applies_the_gguf_adapter_as_edgetrain_does(smollm2_file, tmp_path, targets, std, min_cosine):
    model = _adapted(smollm2_file, targets, std)
    saved = edgetrain.save_lora(model, tmp_path / "adapter.safetensors")
    adapter = convert_adapter(saved, tmp_path / "adapter.gguf", "gguf", base_config=model.config)
    ids, base_logits, base_text = _llama_cpp_run(smollm2_file)
    _, lora_logits, lora_text = _llama_cpp_run(smollm2_file, adapter)
    ours_base, _ = _ours(model, ids, adapter_on=False)
    ours_lora, ours_lora_text = _ours(model, ids)
    base_error, lora_error = _relative(base_logits, ours_base), _relative(lora_logits, ours_lora)
    cosine = _cosine(lora_logits - base_logits, ours_lora - ours_base)
    print(f"targets {targets}: |llama.cpp - edgetrain| / max: base {base_error:.2e}, adapter {lora_error:.2e}; "
          f"change-of-logits cosine {cosine:.3f}; greedy: llama.cpp {lora_text}, edgetrain {ours_lora_text}, "
          f"llama.cpp base {base_text}")
    assert base_error < QUANTISATION_TOLERANCE and lora_error < QUANTISATION_TOLERANCE
    assert cosine > min_cosine
    assert _agrees_under_quantisation(model, ids, lora_text)
    if len(targets) > 2:  # an adapter on every module moves the text
        assert lora_text != base_text


def test_llama_cpp_loads_the_merged_gguf(smollm2_file, tmp_path):
    # Merged weights are dense: the base is loaded dense, as `edgetrain export --merge` loads it.
    model = _adapted(smollm2_file, ("q", "k", "v", "o", "gate", "up", "down"), 0.08, dequantize=True)
    ids, _, _ = _llama_cpp_run(smollm2_file)
    expected, expected_text = _ours(model, ids)  # all prompt positions
    for dtype, tolerance in (("f32", 2e-3), ("f16", 2e-2)):
        merged = save_merged_gguf(model, smollm2_file, tmp_path / f"merged-{dtype}.gguf", dtype)
        _, logits, text = _llama_cpp_run(merged)
        print(f"merged {dtype}: |llama.cpp - edgetrain| / max {_relative(logits, expected):.2e}")
        assert _relative(logits, expected) < tolerance
        assert text == expected_text
