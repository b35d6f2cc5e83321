"""Text from MLX models: the key/value cache gives the full forward's logits, greedy decoding with the
cache equals recomputing everything and equals torch's tokens on the same GGUF file (its projections
kept 4-bit on MLX), seeded sampling picks what torch picks, held-out loss matches torch's; the public
functions and `edgetrain generate` / `edgetrain eval --backend mlx` reach the MLX code through the
backend registry."""
from __future__ import annotations

import json

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install edgetrain[mlx])")
gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")  # test_gguf builds its source models with transformers

import edgetrain  # noqa: E402
from edgetrain.backends.base import BACKENDS  # noqa: E402
from edgetrain.backends.mlx import generate as mlx_generate  # noqa: E402
from edgetrain.backends.mlx.generate import MLXKVCache, forward_cached  # noqa: E402
from edgetrain.backends.mlx.loading import load_mlx_model  # noqa: E402
from edgetrain.backends.mlx.lora import add_lora  # noqa: E402
from edgetrain.backends.mlx.quantize import QuantizedLinear  # noqa: E402
from edgetrain.cli import main  # noqa: E402
from edgetrain.data.batch import Batch  # noqa: E402
from edgetrain.models.generate import generate, generate_ids, held_out_loss  # noqa: E402
from edgetrain.registry import EdgetrainError  # noqa: E402
from testkit import random_lora_b  # noqa: E402

from gguf_testkit import hf_model, write_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def q4_file(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("generate") / "tiny-q4_1.gguf", hf_model(), Q.Q4_1)


@pytest.fixture(scope="module")
def both(q4_file):
    """The same GGUF on torch (dequantised) and on MLX (4-bit)."""
    mlx_model = edgetrain.load_model(q4_file, backend="mlx")
    assert isinstance(mlx_model.blocks[0].self_attn.q_proj, QuantizedLinear)
    return edgetrain.load_model(q4_file), mlx_model


def _mlx_tiny_with_lora():
    model = load_mlx_model("tiny", seed=0)  # GQA, q/k/v bias, tied embeddings
    add_lora(model, rank=4)
    keys = iter(mx.random.split(mx.random.key(2), 64))
    for _, layer in model.named_modules():
        if hasattr(layer, "lora_b"):
            layer.lora_b = mx.random.normal(layer.lora_b.shape, key=next(keys)) * 0.05
    return model


def test_cached_logits_equal_the_full_forward():
    model = _mlx_tiny_with_lora()
    tokens = mx.array(np.random.default_rng(3).integers(0, model.config.vocab_size, (2, 12)).astype(np.int32))
    full = np.array(model(tokens))
    cache = MLXKVCache()
    pieces = [forward_cached(model, tokens[:, :5], cache)]  # a prompt, then one token at a time
    for position in range(5, 12):
        pieces.append(forward_cached(model, tokens[:, position:position + 1], cache))
    assert cache.length == 12
    got = np.array(mx.concatenate(pieces, axis=1))
    # fp32; measured 0 here (bit for bit on the CPU); other kernels may sum the longer rows in another order
    assert np.abs(got - full).max() <= 1e-5 * np.abs(full).max()


def _greedy_without_cache(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(np.array(model(mx.array([ids], dtype=mx.int32)))[0, -1].argmax()))
    return ids[len(prompt):]


def test_greedy_with_the_cache_equals_recomputing_everything_and_torch(both):
    torch_model, mlx_model = both
    prompt = mlx_model.tokenizer.encode(PROMPT)
    tokens = generate_ids(mlx_model, prompt, 12)
    assert tokens == _greedy_without_cache(mlx_model, prompt, 12)
    assert tokens == generate_ids(torch_model, prompt, 12)  # dequantised torch weights, same file


def test_greedy_with_lora_equals_recomputing_everything():
    model = _mlx_tiny_with_lora()
    model.train()
    prompt = list(b"On-device training ")
    assert generate_ids(model, prompt, 10) == _greedy_without_cache(model, prompt, 10)
    assert model.training  # the mode it was in


def test_seeded_sampling_picks_what_torch_picks(both):
    torch_model, mlx_model = both
    prompt = mlx_model.tokenizer.encode(PROMPT)
    first = generate_ids(mlx_model, prompt, 12, temperature=1.5, seed=7)
    assert generate_ids(mlx_model, prompt, 12, temperature=1.5, seed=7) == first
    assert any(generate_ids(mlx_model, prompt, 12, temperature=1.5, seed=s) != first for s in range(8, 12))
    # One decoding loop and one sampler for both frameworks: the same seed draws the same tokens.
    assert first == generate_ids(torch_model, prompt, 12, temperature=1.5, seed=7)
    assert generate_ids(mlx_model, prompt, 6, temperature=0.8, top_p=0.5, seed=3) == \
        generate_ids(torch_model, prompt, 6, temperature=0.8, top_p=0.5, seed=3)
    assert generate_ids(mlx_model, prompt, 6, temperature=1.0, top_p=1e-9) == generate_ids(mlx_model, prompt, 6)


def test_stop_ids_and_text_through_the_public_functions(both):
    torch_model, mlx_model = both
    prompt = mlx_model.tokenizer.encode(PROMPT)
    greedy = generate_ids(mlx_model, prompt, 8)
    assert generate_ids(mlx_model, prompt, 8, stop_ids=[greedy[2]]) == greedy[:greedy.index(greedy[2]) + 1]
    # edgetrain.generate hands the MLX model to the MLX backend's text module (Backend.text_out).
    assert edgetrain.generate(mlx_model, PROMPT, 8) == mlx_generate.generate(mlx_model, PROMPT, 8)
    assert edgetrain.generate(mlx_model, PROMPT, 8) == generate(torch_model, PROMPT, 8)
    assert BACKENDS.get("mlx").text_functions() is mlx_generate


def _batches(vocab: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(4)
    batches = [Batch(torch.randint(0, vocab, (2, 16), generator=generator),
                     torch.randint(0, vocab, (2, 16), generator=generator), i) for i in range(3)]
    batches[1].targets[0, :4] = -100
    return batches


def test_held_out_loss_matches_torch(both):
    torch_model, mlx_model = both
    batches = _batches(mlx_model.config.vocab_size)
    expected = held_out_loss(torch_model, batches)
    found = edgetrain.held_out_loss(mlx_model, batches)  # routed to the MLX module
    assert (found.tokens, found.batches) == (expected.tokens, expected.batches) == (92, 3)
    # fp32 logits on both sides, losses summed in float64; measured 3.1e-8 relative
    assert found.loss == pytest.approx(expected.loss, rel=1e-6)
    assert found.perplexity == pytest.approx(np.exp(found.loss), rel=1e-12)
    with pytest.raises(EdgetrainError, match="no tokens"):
        held_out_loss(mlx_model, [])


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": 0}, "max_new_tokens must be a whole number >= 1"),
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"prompt_ids": []}, "prompt is empty"),
    ({"prompt_ids": [1, 9999]}, r"prompt token id 9999 is outside the model's vocabulary \[0, 256\)"),
])
def test_bad_settings_are_refused_as_on_torch(kwargs, message):
    model = load_mlx_model("tiny", seed=0)
    arguments = {"prompt_ids": [1, 2], "max_new_tokens": 4, **kwargs}
    with pytest.raises(EdgetrainError, match=message):
        generate_ids(model, **arguments)


def test_an_object_no_backend_runs_is_refused_by_name():
    with pytest.raises(EdgetrainError, match="no backend generates text with a str"):
        generate_ids("not a model", [1], 4)


# ---------------------------------------------------------------------------------------------------
# The CLI


def _run(capsys, *argv: str) -> str:
    assert main([*argv, "--quiet"]) == 0
    return capsys.readouterr().out


def test_cli_generate_on_mlx_writes_torchs_text_also_with_an_adapter(q4_file, tmp_path, capsys):
    flags = ["generate", "--model", str(q4_file), "--prompt", PROMPT, "--max-tokens", "8"]
    text = _run(capsys, *flags, "--backend", "mlx")
    assert text.strip() and text == _run(capsys, *flags)
    torch_model = edgetrain.load_model(q4_file)
    edgetrain.add_lora(torch_model, rank=4)
    random_lora_b(torch_model, 1, 0.5)
    edgetrain.save_lora(torch_model, tmp_path / "adapter.safetensors")
    adapted = [*flags, "--adapter", str(tmp_path / "adapter.safetensors")]
    tuned = _run(capsys, *adapted, "--backend", "mlx")
    assert tuned != text and tuned == _run(capsys, *adapted)


def test_cli_eval_on_mlx_prints_torchs_loss(q4_file, tmp_path, capsys):
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    flags = ["eval", "--model", str(q4_file), "--data", str(held_out), "--seq", "16", "--batch", "2"]
    found = json.loads(_run(capsys, *flags, "--backend", "mlx"))
    expected = json.loads(_run(capsys, *flags))
    assert found["tokens"] == expected["tokens"] > 0 and found["batches"] == expected["batches"]
    assert found["loss"] == pytest.approx(expected["loss"], rel=1e-6)


def test_cli_refuses_a_backend_that_cannot_read_text_out(monkeypatch, capsys):
    import dataclasses

    import edgetrain.backends as backends

    mute = dataclasses.replace(BACKENDS.get("mlx"), reads_text_out=False)
    monkeypatch.setattr(backends, "get_backend", lambda name: mute)
    assert main(["generate", "--backend", "mlx", "--prompt", "x"]) == 2
    assert "backend 'mlx' cannot generate or evaluate text yet" in capsys.readouterr().err
