"""tools/make_arch_fixtures.py run again (slow: it fetches llama-cpp-python's source distribution through the
package index once, for llama.cpp's converter, and runs it): the models it makes now load to transformers'
live logits, from the checkpoint directory and from the converter's GGUF, and follow llama.cpp's when
llama-cpp-python is installed."""
from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from testkit import load_tool

pytestmark = pytest.mark.slow


def test_remade_fixtures_load_to_transformers_and_llama_cpps_logits(tmp_path):
    import torch

    import edgetrain
    from gguf_blocks_testkit import assert_follows_llama_cpp

    tool = load_tool("make_arch_fixtures")
    try:
        source = tool.llama_cpp_source(Path.home() / ".cache" / "edgetrain" / "llama-cpp-src")
    except (subprocess.CalledProcessError, StopIteration) as exc:
        pytest.skip(f"llama.cpp's converter could not be fetched (offline?): {exc}")
    manifest = tool.make(tmp_path, source)
    stored = np.load(tmp_path / "logits.npz")
    ids = torch.tensor([manifest["tokens"]])
    for name, info in manifest["models"].items():
        expected = stored[f"{name}.transformers"]
        for path in (tmp_path / info["checkpoint"], tmp_path / info["gguf"]):
            with torch.no_grad():
                got = edgetrain.load_model(path)(ids)[0].double().numpy()
            assert float(np.abs(got - expected).max() / np.abs(expected).max()) <= 1e-5, path
        if info["llama_cpp"]:
            assert_follows_llama_cpp(got, stored[f"{name}.llama_cpp"], name)
