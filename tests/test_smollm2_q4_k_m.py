"""SmolLM2-135M as a Q4_K_M file made by llama.cpp's own quantizer from the downloaded Q4_1 weights
(tools/requantize_gguf.py, as docs/gguf.md makes it), on the user paths with default flags: every matrix
stays packed (Q4_K, Q6_K, and the Q5_0 / Q8_0 llama.cpp falls back to for SmolLM2's 576-wide rows), the
README's train/eval lowers held-out perplexity by >= 20%, and personalise run trains on it. Slow: it
downloads the model and needs the llamacpp extra (which compiles llama.cpp)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgetrain.cli import main
from edgetrain.models.quantized import PackedMatrix
from testkit import load_tool

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'edgetrain[llamacpp]')")
pytestmark = pytest.mark.slow



@pytest.fixture(scope="module")
def q4_k_m(smollm2_file, tmp_path_factory):
    tool = load_tool("requantize_gguf")
    out = tmp_path_factory.mktemp("q4_k_m") / "smollm2-q4_k_m.gguf"
    types = tool.requantize(Path(smollm2_file), out, "Q4_K_M")
    assert types["Q4_K"] > 0 and types["Q6_K"] > 0 and types["Q5_0"] > 0
    return out


def _eval(capsys, model, data, *flags) -> float:
    capsys.readouterr()  # what earlier commands printed (train's summary line)
    assert main(["eval", "--model", str(model), "--data", str(data), "--seq", "128", "--batch", "2",
                 "--max-batches", "4", "--quiet", *flags]) == 0
    return json.loads(capsys.readouterr().out)["perplexity"]


def test_the_readme_path_on_a_q4_k_m_file_learns_and_keeps_every_matrix_packed(q4_k_m, loaded, tmp_path, capsys):
    from pydoc_data.topics import topics

    keys = sorted(topics)
    notes, held_out = tmp_path / "notes.txt", tmp_path / "held-out.txt"
    notes.write_text("".join(topics[k] for k in keys[:60]))
    held_out.write_text("".join(topics[k] for k in keys[60:75]))
    before = _eval(capsys, q4_k_m, held_out)
    adapter = tmp_path / "adapter.safetensors"
    assert main(["train", "--model", str(q4_k_m), "--method", "mesp", "--files", str(notes), "--steps", "40",
                 "--seq", "128", "--batch", "2", "--lr", "2e-3", "--save-adapter", str(adapter), "--quiet"]) == 0
    after = _eval(capsys, q4_k_m, held_out, "--adapter", str(adapter))
    assert after <= 0.8 * before, (before, after)
    formats = {m.layout.format_name for model in loaded for m in model.modules() if isinstance(m, PackedMatrix)}
    assert formats == {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}


def test_personalise_run_trains_on_a_q4_k_m_file(q4_k_m, loaded, tmp_path):
    store = tmp_path / "store"
    notes = []
    for index in range(6):
        notes.append(tmp_path / f"note{index}.txt")
        notes[-1].write_text(f"Note {index}. The with statement wraps a block in a context manager's methods. " * 3)
    assert main(["personalise", "add", "--store", str(store), "--quiet", *map(str, notes)]) == 0
    assert main(["personalise", "run", "--store", str(store), "--model", str(q4_k_m), "--max-steps", "2",
                 "--window-steps", "2", "--seq", "32", "--batch", "2", "--quiet"]) == 0
    assert loaded and all(sum(isinstance(m, PackedMatrix) for m in model.modules()) == 7 * 30 + 1 for model in loaded)
