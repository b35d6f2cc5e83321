"""Generation with a key/value cache equals the model's full forward, greedy decoding equals transformers'
on the same GGUF file, sampling is seeded, bad settings are refused by name; held-out loss and perplexity
are the mean token cross-entropy and its exponential."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import edgetrain
from edgetrain.data.batch import Batch
from edgetrain.models.generate import KVCache, forward_cached, generate, generate_ids, held_out_loss
from edgetrain.registry import EdgetrainError
from testkit import random_lora_b


def _model(lora: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = edgetrain.load_model("tiny").double()  # GQA, q/k/v bias, tied embeddings
    if lora:
        edgetrain.add_lora(model, rank=4)
        random_lora_b(model, 1, 0.05)
    return model


@pytest.mark.parametrize("lora", [False, True])
def test_cached_logits_equal_the_full_forward(lora):
    model = _model(lora)
    tokens = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    full = model(tokens)
    cache = KVCache()
    pieces = [forward_cached(model, tokens[:, :5], cache)]  # a prompt, then one token at a time
    for position in range(5, 12):
        pieces.append(forward_cached(model, tokens[:, position:position + 1], cache))
    assert cache.length == 12
    assert torch.allclose(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-10)


def _greedy_without_cache(model, prompt, steps):
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def test_greedy_generation_equals_recomputing_everything():
    model = _model(lora=True)
    prompt = list(b"On-device training ")
    assert generate_ids(model, prompt, 10) == _greedy_without_cache(model, prompt, 10)
    assert model.training  # the mode it was in


def test_greedy_generation_equals_transformers_on_the_same_gguf(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from gguf_testkit import hf_model, write_gguf

    path = write_gguf(tmp_path / "small.gguf", hf_model())
    ours = edgetrain.load_model(path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
    prompt = ours.tokenizer.encode("The quick brown fox")
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    # transformers stops at the file's end-of-sequence id (and keeps it): so does ours when told to.
    assert generate_ids(ours, prompt, 8, stop_ids=[ours.tokenizer.eos_token_id]) == expected


def test_sampling_is_seeded_and_a_tiny_top_p_is_greedy():
    model = _model()
    prompt = list(b"hello")
    first = generate_ids(model, prompt, 12, temperature=1.5, seed=7)
    assert generate_ids(model, prompt, 12, temperature=1.5, seed=7) == first
    assert any(generate_ids(model, prompt, 12, temperature=1.5, seed=s) != first for s in range(8, 12))
    assert generate_ids(model, prompt, 6, temperature=1.0, top_p=1e-9) == generate_ids(model, prompt, 6)


def test_generation_stops_at_a_stop_id_and_text_round_trips():
    model = _model()
    prompt = list(b"abc")
    greedy = generate_ids(model, prompt, 8)
    assert generate_ids(model, prompt, 8, stop_ids=[greedy[2]]) == greedy[:greedy.index(greedy[2]) + 1]
    assert generate(model, "abc", 8) == bytes(greedy).decode("utf-8", errors="replace")


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": 0}, "max_new_tokens must be a whole number >= 1"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, "top_p"),
])
def test_bad_sampling_settings_are_refused(kwargs, message):
    with pytest.raises(EdgetrainError, match=message):
        generate_ids(_model(), [1, 2], **{"max_new_tokens": 4, **kwargs})


def test_bad_prompts_and_models_are_refused():
    model = _model()
    with pytest.raises(EdgetrainError, match="prompt is empty"):
        generate_ids(model, [], 4)
    with pytest.raises(EdgetrainError, match=r"prompt token id 9999 is outside the model's vocabulary \[0, 256\)"):
        generate_ids(model, [1, 9999], 4)
    with pytest.raises(EdgetrainError, match="needs a decoder language model"):
        generate_ids(edgetrain.load_model("mlp-digits"), [1], 4)


def test_held_out_loss_is_the_mean_token_cross_entropy():
    model = _model()
    generator = torch.Generator().manual_seed(4)
    batches = [Batch(torch.randint(0, 256, (2, 6), generator=generator), torch.randint(0, 256, (2, 6),
                     generator=generator), i) for i in range(3)]
    batches[1].targets[0, :4] = -100
    with torch.no_grad():
        losses = torch.cat([F.cross_entropy(model(b.inputs).flatten(0, 1), b.targets.flatten(), ignore_index=-100,
                                            reduction="none")[b.targets.flatten() != -100] for b in batches])
    found = held_out_loss(model, batches)
    assert found.tokens == 32 and found.batches == 3
    assert found.loss == pytest.approx(float(losses.mean()), rel=1e-12)
    assert found.perplexity == pytest.approx(math.exp(float(losses.mean())), rel=1e-12)
    with pytest.raises(EdgetrainError, match="no tokens"):
        held_out_loss(model, [])
