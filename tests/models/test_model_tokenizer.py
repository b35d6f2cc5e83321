"""One tokenizer per model: a checkpoint directory's tokenizer.json is loaded with its weights and is what
`edgetrain train` streams and `edgetrain profile` feeds; presets (no vocabulary file) use bytes."""
from __future__ import annotations

import json

import pytest
import torch

import edgetrain
from edgetrain.data.tokenizer import ByteTokenizer, HFTokenizer, model_tokenizer
from edgetrain.registry import EdgetrainError

VOCAB = {"[UNK]": 0, "hello": 1, "world": 2, "device": 3}


def write_checkpoint(directory, vocab_size: int = 50, tokenizer_vocab: dict | None = VOCAB):
    from safetensors.torch import save_file

    from edgetrain.models.llama import LlamaConfig, LlamaModel, edgetrain_key_to_hf

    directory.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, model_type="llama")
    torch.manual_seed(0)
    model = LlamaModel(config)
    model.init_weights()
    save_file({edgetrain_key_to_hf(k): v.contiguous() for k, v in model.state_dict().items()
               if k != "head.lm_head.weight"}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": vocab_size, "hidden_size": 16, "intermediate_size": 24,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}))
    if tokenizer_vocab is not None:
        from tokenizers import Tokenizer, models, pre_tokenizers

        tokenizer = Tokenizer(models.WordLevel(tokenizer_vocab, unk_token="[UNK]"))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def test_a_checkpoint_brings_its_tokenizer_and_a_preset_uses_bytes(tmp_path):
    model = edgetrain.load_model(write_checkpoint(tmp_path / "ckpt"))
    assert isinstance(model.tokenizer, HFTokenizer) and model_tokenizer(model).encode("hello device") == [1, 3]
    assert isinstance(model_tokenizer(edgetrain.load_model("tiny")), ByteTokenizer)
    bare = edgetrain.load_model(write_checkpoint(tmp_path / "bare", tokenizer_vocab=None))
    assert isinstance(model_tokenizer(bare), ByteTokenizer)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path):
    big = {f"w{i}": i for i in range(60)} | {"[UNK]": 60}
    with pytest.raises(EdgetrainError, match="tokenizer has 61 ids but the model's vocabulary only 50"):
        edgetrain.load_model(write_checkpoint(tmp_path / "ckpt", tokenizer_vocab=big))


def test_train_streams_the_checkpoints_tokens(tmp_path, monkeypatch):
    import edgetrain.data
    from edgetrain.cli import main

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world device " * 200)
    seen = []
    real = edgetrain.data.make_stream

    def spy(name, **options):
        stream = real(name, **options)
        seen.append(stream)
        return stream
    monkeypatch.setattr(edgetrain.data, "make_stream", spy)
    assert main(["train", "--model", str(write_checkpoint(tmp_path / "ckpt")), "--method", "bp", "--steps", "2",
                 "--seq", "8", "--batch", "2", "--rank", "2", "--files", str(corpus), "--quiet"]) == 0
    batch = next(iter(seen[0]))
    assert set(batch.inputs.flatten().tolist()) == {1, 2, 3}  # word ids, not bytes


def test_profile_feeds_the_checkpoints_tokens(tmp_path):
    from edgetrain.profiler.batches import build_batch
    from edgetrain.profiler.config import ProfileConfig

    model = edgetrain.load_model(write_checkpoint(tmp_path / "ckpt"))
    batch = build_batch(model, ProfileConfig(model=str(tmp_path / "ckpt"), seq=16, batch=2))
    # pydoc's English: mostly words this 4-word vocabulary does not know ([UNK] = 0), none a byte id.
    assert set(batch.inputs.flatten().tolist()) <= set(VOCAB.values()) and batch.inputs.shape == (2, 16)


def test_mlx_loads_the_same_tokenizer(tmp_path):
    pytest.importorskip("mlx.core")
    from edgetrain.backends.mlx.loading import load_mlx_model

    model = load_mlx_model(write_checkpoint(tmp_path / "ckpt"))
    assert model_tokenizer(model).encode("world hello") == [2, 1]
