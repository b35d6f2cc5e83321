"""Adapters travel on today's architectures (tests/fixtures/arch, remade by tools/make_arch_fixtures.py): an
edgetrain adapter loads in PEFT onto transformers' model with edgetrain's logits; as a llama.cpp LoRA GGUF it is
the committed file byte for byte, llama.cpp's logits with it (stored beside the fixtures) follow edgetrain's,
and the file reads back into edgetrain with the same logits."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import edgetrain
from gguf_blocks_testkit import assert_follows_llama_cpp
from testkit import load_tool

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "arch"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
STORED = np.load(FIXTURES / "logits.npz")
TOKENS = [int(t) for t in STORED["tokens"]]
ARCHITECTURES = sorted(MANIFEST["models"])
tool = load_tool("make_arch_fixtures")


def _logits(model) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(torch.tensor([TOKENS]))[0].double().numpy()


def _relative(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(got - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_the_gguf_lora_is_the_committed_file_and_llama_cpp_follows_it(name, tmp_path):
    adapted = tool.fixture_adapter(FIXTURES / MANIFEST["models"][name]["gguf"])
    written = tool.write_fixture_adapter(adapted, tmp_path / "adapter.gguf")
    assert written.read_bytes() == (FIXTURES / MANIFEST["models"][name]["lora"]).read_bytes()
    ours = _logits(adapted)
    assert _relative(ours, STORED[f"{name}.edgetrain_lora"]) <= 1e-5
    if f"{name}.llama_cpp_lora" not in STORED:
        pytest.skip("the fixtures were made without llama-cpp-python")
    assert_follows_llama_cpp(ours, STORED[f"{name}.llama_cpp_lora"], f"{name} with the adapter")
    # The adapter moved llama.cpp's logits the way it moved edgetrain's.
    theirs_change = STORED[f"{name}.llama_cpp_lora"] - STORED[f"{name}.llama_cpp"]
    ours_change = ours - STORED[f"{name}.transformers"]
    assert np.abs(theirs_change).max() > 0.1 * np.abs(STORED[f"{name}.llama_cpp"]).max()
    assert np.corrcoef(theirs_change.ravel(), ours_change.ravel())[0, 1] >= 0.999


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_the_gguf_lora_reads_back_with_the_same_logits(name):
    from edgetrain.adapters.convert import load_adapter

    model = edgetrain.load_model(FIXTURES / MANIFEST["models"][name]["gguf"])
    load_adapter(model, FIXTURES / MANIFEST["models"][name]["lora"])  # what generate/eval --adapter do
    assert _relative(_logits(model), STORED[f"{name}.edgetrain_lora"]) <= 1e-5


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_an_edgetrain_adapter_loads_in_peft_with_the_same_logits(name, tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from edgetrain.adapters.peft import save_peft_adapter

    checkpoint = FIXTURES / MANIFEST["models"][name]["checkpoint"]
    adapted = tool.fixture_adapter(checkpoint)
    out = save_peft_adapter(adapted, tmp_path / "adapter", base_model=str(checkpoint))
    base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(base, str(out)).eval()(torch.tensor([TOKENS])).logits[0]
    assert _relative(theirs.double().numpy(), _logits(adapted)) <= 1e-5
    assert _relative(theirs.double().numpy(), STORED[f"{name}.transformers"]) > 1e-2  # the adapter matters
