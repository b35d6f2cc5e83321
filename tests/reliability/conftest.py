"""Fixtures of the adversarial suite, and the printout of its case counts (fault_tally.py)."""
from __future__ import annotations

import json
import shutil

import pytest

import fault_tally


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """A small Qwen2-style checkpoint in the Hugging Face layout (tied embeddings, q/k/v bias)."""
    from safetensors.torch import save_file

    from edgetrain.models.llama import LlamaConfig, LlamaModel, edgetrain_key_to_hf

    directory = tmp_path_factory.mktemp("ckpt")
    config = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                         tie_word_embeddings=True, model_type="qwen2")
    model = LlamaModel(config)
    model.init_weights()
    state = {edgetrain_key_to_hf(k): v.contiguous() for k, v in model.state_dict().items()
             if k != "head.lm_head.weight"}
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "vocab_size": 50, "hidden_size": 16, "intermediate_size": 24,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "tie_word_embeddings": True}))
    return directory


@pytest.fixture
def copy_checkpoint(checkpoint_dir, tmp_path):
    """copy_checkpoint(name) -> a fresh copy of checkpoint_dir to damage (the same name is replaced, so
    that hypothesis examples sharing one tmp_path start clean)."""
    def copy(name: str = "copy"):
        target = tmp_path / name
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(checkpoint_dir, target)
        return target
    return copy


def pytest_terminal_summary(terminalreporter):
    if fault_tally.COUNTS:
        terminalreporter.section("adversarial cases (tests/reliability)")
        for line in fault_tally.table():
            terminalreporter.write_line(line)
