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


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_the_mlx_lm_adapter_gives_edgetrains_logits_on_mlx(name, tmp_path):
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed")
    import edgetrain as et
    from edgetrain.adapters.convert import convert_adapter, load_adapter_into_mlx

    saved = et.save_lora(tool.fixture_adapter(FIXTURES / MANIFEST["models"][name]["gguf"]), tmp_path / "a.safetensors")
    mlx_lm = convert_adapter(saved, tmp_path / "mlx-lm", "mlx-lm")
    model = load_adapter_into_mlx(et.load_model(FIXTURES / MANIFEST["models"][name]["gguf"], backend="mlx"), mlx_lm)
    got = np.array(model(mx.array(np.array([TOKENS], dtype=np.int32))))[0]
    assert _relative(got, STORED[f"{name}.edgetrain_lora"]) <= 1e-5


# mlx-lm 0.32 reads Llama 3's RoPE scaling from `rope_scaling`, which transformers 5 writes as `rope_parameters`:
# on the llama3 fixture mlx-lm's own base model is off by itself (1.3 of the largest logit), adapter or none.
MLX_LM_READS = [name for name in ARCHITECTURES if name != "llama3"]


@pytest.mark.parametrize("name", MLX_LM_READS)
def test_mlx_lm_itself_runs_the_adapter_with_edgetrains_logits(name, tmp_path):
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed")
    pytest.importorskip("mlx_lm.tuner.utils", reason="mlx-lm is not installed")
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import load_model

    from edgetrain.adapters.convert import convert_adapter

    saved = edgetrain.save_lora(tool.fixture_adapter(FIXTURES / MANIFEST["models"][name]["gguf"]),
                                tmp_path / "a.safetensors")
    model, _ = load_model(FIXTURES / MANIFEST["models"][name]["checkpoint"])  # mlx-lm's own model class
    load_adapters(model, str(convert_adapter(saved, tmp_path / "mlx-lm", "mlx-lm")))
    got = np.array(model(mx.array(np.array([TOKENS], dtype=np.int32))))[0]
    assert _relative(got, STORED[f"{name}.edgetrain_lora"]) <= 1e-5
