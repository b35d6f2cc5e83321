"""SentencePiece vocabularies in GGUF files (`tokenizer.ggml.model` "llama": Gemma, Llama 2): the GGUFs llama.cpp's
converter made of a BPE SentencePiece model with byte fallback and Gemma's turn markers (tests/fixtures/arch,
tools/make_arch_fixtures.py) split every text into llama.cpp's own ids -- with the space prefix (llama) and
without (gemma3), special tokens whole, bytes where no token covers a character -- and decode back."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import edgetrain
from edgetrain.models.gguf.reader import GGUFError
from edgetrain.models.gguf.tokenizer import load_gguf_tokenizer

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "arch"
SPM = json.loads((FIXTURES / "manifest.json").read_text())["sentencepiece"]
pytest.importorskip("tokenizers")


@pytest.mark.parametrize("kind", sorted(SPM["models"]))
def test_every_text_splits_into_llama_cpps_ids(kind):
    stored = SPM["models"][kind]["llama_cpp_ids"]
    if stored is None:
        pytest.skip("the fixtures were made without llama-cpp-python")
    tokenizer = load_gguf_tokenizer(FIXTURES / SPM["models"][kind]["gguf"])
    for text, ids in zip(SPM["texts"], stored):
        assert tokenizer.encode(text) == ids, text


@pytest.mark.parametrize("kind", sorted(SPM["models"]))
def test_the_model_loads_with_its_tokenizer_and_text_round_trips(kind):
    model = edgetrain.load_model(FIXTURES / SPM["models"][kind]["gguf"])
    tokenizer = model.tokenizer
    assert tokenizer.decode(tokenizer.encode("Grüße aus Köln 🤖\nnew line")) in (
        "Grüße aus Köln 🤖\nnew line", " Grüße aus Köln 🤖\nnew line")  # llama's prefixed space, or none
    assert tokenizer.encode("<start_of_turn>") == [tokenizer._tokenizer.token_to_id("<start_of_turn>")]


def test_a_damaged_sentencepiece_vocabulary_is_refused_by_name(tmp_path):
    from edgetrain.models.gguf.reader import read_gguf
    from edgetrain.models.gguf.tokenizer import gguf_tokenizer

    gguf = read_gguf(FIXTURES / SPM["models"]["gemma3"]["gguf"])
    gguf.metadata["tokenizer.ggml.scores"] = gguf.metadata["tokenizer.ggml.scores"][:-1]
    with pytest.raises(GGUFError, match="'tokenizer.ggml.scores' must be an array of .* finite numbers"):
        gguf_tokenizer(gguf)
    gguf = read_gguf(FIXTURES / SPM["models"]["gemma3"]["gguf"])
    del gguf.metadata["tokenizer.ggml.scores"]
    with pytest.raises(GGUFError, match="needs 'tokenizer.ggml.scores'"):
        gguf_tokenizer(gguf)
