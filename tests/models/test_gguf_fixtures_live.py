"""tools/make_gguf_fixtures.py run again with llama.cpp itself (slow: needs the llamacpp extra, which compiles
llama.cpp): the files it makes now hold the same tensor types as the committed fixtures, edgetrain reads them
to llama.cpp's live logits, and llama.cpp's logits on the committed files are the stored ones."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from testkit import load_tool

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install "
                                                     "'edgetrain[llamacpp]'; it compiles llama.cpp)")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "gguf"


def test_remade_fixtures_hold_the_same_types_and_follow_llama_cpp_live(tmp_path):
    import torch

    from edgetrain.models.gguf.loader import load_gguf
    from gguf_blocks_testkit import assert_follows_llama_cpp

    tool = load_tool("make_gguf_fixtures")
    manifest = tool.make(tmp_path)
    stored = json.loads((FIXTURES / "manifest.json").read_text())
    assert manifest["tokens"] == stored["tokens"]
    live = np.load(tmp_path / "llama_cpp_logits.npz")
    for file_type, info in manifest["files"].items():
        assert info["types"] == stored["files"][file_type]["types"], file_type
        model = load_gguf(tmp_path / info["file"], quantized=True)
        with torch.no_grad():
            ours = model(torch.tensor([manifest["tokens"]]))[0].double().numpy()
        assert_follows_llama_cpp(ours, live[file_type], file_type)
        # llama.cpp on the committed file gives the logits stored beside it.
        committed = tool.llama_cpp_logits(FIXTURES / info["file"], manifest["tokens"])
        np.testing.assert_allclose(committed, np.load(FIXTURES / "llama_cpp_logits.npz")[file_type], rtol=0,
                                   atol=1e-3 * np.abs(committed).max())
