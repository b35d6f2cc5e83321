"""SmolLM2-135M's own GGUF on the user paths with default flags: its Q4_1 blocks and Q8_0 embedding stay
packed for train, eval and personalise run, and eval's perplexity equals the dequantised base's to 1e-4
relative (slow lane: it downloads the model once; tests/test_packed_base_paths.py has the same on a GGUF
the tests write)."""
from __future__ import annotations

import json

import pytest

import edgetrain
from edgetrain.cli import main
from edgetrain.models.quantized import packed_matrix_count

pytestmark = pytest.mark.slow

TEXT = "The with statement is used to wrap the execution of a block with methods defined by a context manager. "


def test_eval_on_the_packed_base_equals_the_dequantised_base(smollm2_file, loaded, tmp_path, capsys):
    data = tmp_path / "held_out.txt"
    data.write_text(TEXT * 40)
    results = []
    for flags in ([], ["--dequantize"]):
        assert main(["eval", "--model", str(smollm2_file), "--data", str(data), "--seq", "64", "--batch", "2",
                     "--max-batches", "2", "--quiet", *flags]) == 0
        results.append(json.loads(capsys.readouterr().out))
    packed, dense = results
    assert packed_matrix_count(loaded[0]) == 7 * 30 + 1 and packed_matrix_count(loaded[1]) == 0
    assert packed["tokens"] == dense["tokens"] and packed["loss"] == pytest.approx(dense["loss"], rel=1e-4)


def test_train_and_personalise_keep_smollm2_packed(smollm2_file, loaded, tmp_path):
    data = tmp_path / "notes.txt"
    data.write_text(TEXT * 20)
    assert main(["train", "--model", str(smollm2_file), "--method", "mesp", "--files", str(data), "--steps", "2",
                 "--seq", "32", "--batch", "2", "--quiet"]) == 0
    store = tmp_path / "store"
    notes = []
    for index in range(6):
        notes.append(tmp_path / f"note{index}.txt")
        notes[-1].write_text(f"Note {index}. " + TEXT * 3)
    assert main(["personalise", "add", "--store", str(store), "--quiet", *map(str, notes)]) == 0
    assert main(["personalise", "run", "--store", str(store), "--model", str(smollm2_file), "--max-steps", "2",
                 "--window-steps", "2", "--seq", "32", "--batch", "2", "--quiet"]) == 0
    assert len(loaded) >= 2 and all(packed_matrix_count(model) == 7 * 30 + 1 for model in loaded)
    with edgetrain.Personaliser(store) as personaliser:
        assert personaliser.bound["method"] == "mesp" and personaliser.bound["load"]["dequantize"] is False
