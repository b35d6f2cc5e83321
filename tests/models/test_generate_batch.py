"""Greedy answers to many prompts in one batch (edgetrain.models.generate_batch): left padding changes no
logit, the answers are those of one prompt at a time, stop ids cut them, an interruption is honoured, and
bad prompts are refused. On the tiny preset (GQA, q/k/v bias) in float64, with LoRA adapters, and on a
4-bit packed base."""
from __future__ import annotations

import pytest
import torch

import edgetrain
from edgetrain.models.generate import KVCache, forward_cached, generate_ids
from edgetrain.models.generate_batch import _forward, answer_ids, greedy_answers, prompt_mask
from edgetrain.models.lora import LoraConfig, add_lora
from edgetrain.registry import EdgetrainError

PROMPTS = [[72, 101, 108, 108, 111], [87], [84, 104, 101, 32, 99, 97, 116, 32, 115, 97, 116], [65, 66]]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = edgetrain.load_model("tiny").double()
    with torch.no_grad():  # at the preset's init every answer repeats one token; these weights say more
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, 0.1)
    add_lora(model, LoraConfig(rank=4))
    with torch.no_grad():  # adapters that change the output, so they are part of what is compared
        for name, parameter in model.named_parameters():
            if "lora_b" in name:
                parameter.normal_(0, 0.05)
    return model.eval()


def test_left_padding_changes_no_logit():
    model = _model()
    width = max(map(len, PROMPTS))
    padded = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    for row, prompt in enumerate(PROMPTS):
        padded[row, width - len(prompt):] = torch.tensor(prompt)
    _, visible = prompt_mask([len(p) for p in PROMPTS], width, torch.device("cpu"))
    with torch.no_grad():
        batched = _forward(model, padded, KVCache(), visible)
    for row, prompt in enumerate(PROMPTS):
        alone = forward_cached(model, torch.tensor([prompt]), KVCache(), last_only=True)[0, -1]
        # Not to float64's rounding: RoPE's angles are float32 (edgetrain.models.llama), and a row shifted by
        # its padding takes its positions' angles from other entries of the table.
        torch.testing.assert_close(batched[row], alone, rtol=1e-5, atol=1e-6)


def test_the_answers_are_those_of_one_prompt_at_a_time():
    model = _model()
    answers = greedy_answers(model, PROMPTS, 12)
    assert answers == [generate_ids(model, prompt, 12) for prompt in PROMPTS]
    assert model.training is False


def test_a_stop_id_ends_an_answer_before_it_and_finished_rows_leave_the_batch():
    model = _model()
    free = [generate_ids(model, prompt, 10) for prompt in PROMPTS]
    # A token some answer says first at position >= 2: that answer must stop just before it.
    row, at = next((row, at) for row, alone in enumerate(free) for at in range(2, len(alone))
                   if alone[at] not in alone[:at])
    stop = free[row][at]
    answers = greedy_answers(model, PROMPTS, 10, stop_ids=[stop])
    for answer, alone in zip(answers, free):
        expected = alone[:alone.index(stop)] if stop in alone else alone
        assert answer == expected
    assert len(answers[row]) == at


def test_a_packed_base_answers_as_it_does_one_prompt_at_a_time():
    from edgetrain.models.quantize import quantize_base

    torch.manual_seed(0)
    dense = edgetrain.load_model("tiny")
    with torch.no_grad():
        for parameter in dense.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, 0.1)
    quantize_base(dense, 4)
    model = dense.eval()
    assert answer_ids(model, PROMPTS, 8) == [generate_ids(model, prompt, 8) for prompt in PROMPTS]


def test_an_interruption_ends_it_and_bad_prompts_are_refused():
    model = _model()
    calls = []

    def interrupted() -> bool:
        calls.append(1)
        return len(calls) > 3

    with pytest.raises(InterruptedError):
        greedy_answers(model, PROMPTS, 20, interrupted=interrupted)
    assert len(calls) == 4
    with pytest.raises(EdgetrainError, match="empty"):
        greedy_answers(model, [[1], []], 4)
    with pytest.raises(EdgetrainError, match="outside the model's vocabulary"):
        greedy_answers(model, [[1, 10**6]], 4)
    with pytest.raises(EdgetrainError, match="max_new_tokens"):
        greedy_answers(model, PROMPTS, 0)
    with pytest.raises(EdgetrainError, match="decoder"):
        greedy_answers(edgetrain.load_model("mlp-digits"), PROMPTS, 4)
    assert greedy_answers(model, [], 4) == []


def test_prompts_are_answered_in_groups_whose_cache_fits_the_budget(monkeypatch):
    """A cache for every prompt at once outgrew a training step (the personaliser's retain set: 32 prompts,
    159 MB on SmolLM2): prompts of similar length go together, as many as fit `cache_budget_bytes`, and the
    answers come back in the prompts' order, equal to one prompt at a time."""
    from edgetrain.models import generate_batch

    model = _model()
    groups = []
    answer_group = generate_batch._answer_group

    def spy(model, prompts, *args):
        groups.append([len(p) for p in prompts])
        return answer_group(model, prompts, *args)

    monkeypatch.setattr(generate_batch, "_answer_group", spy)
    per_row = generate_batch.cache_bytes_per_row(model, max(map(len, PROMPTS)) + 8)
    answers = greedy_answers(model, PROMPTS, 8, cache_budget_bytes=2 * per_row)
    assert answers == [generate_ids(model, prompt, 8) for prompt in PROMPTS]
    assert groups == [[1, 2], [5, 11]]  # shortest first, two rows a group
    for group in groups:
        assert len(group) * generate_batch.cache_bytes_per_row(model, max(group) + 8) <= 2 * per_row
    groups.clear()
    assert greedy_answers(model, PROMPTS, 8, cache_budget_bytes=1) == answers  # at least one row a group
    assert groups == [[1], [2], [5], [11]]
    groups.clear()
    greedy_answers(model, PROMPTS, 8)  # the default budget holds these tiny rows all at once
    assert groups == [[1, 2, 5, 11]]
    # positions x blocks x keys and values x the key/value width x 8 bytes (float64)
    config = model.config
    assert generate_batch.cache_bytes_per_row(model, 10) == (10 * len(model.blocks) * 2 * config.num_key_value_heads
                                                             * config.head_dim * 8)
