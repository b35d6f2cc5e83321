"""The forgetting guard on a real model (slow lane: SmolLM2-135M-Instruct from its GGUF, base kept packed):
the retain set is the model's own chat answers to the shipped prompts, cut at its end of turn, and a
candidate trained hard on one narrow note is rejected for forgetting while its user side would pass."""
from __future__ import annotations

import json

import pytest

from edgetrain.personalise import Personaliser, Policy
from edgetrain.personalise.general_prompts import GENERAL_PROMPTS
from personalise_kit import Recorder

pytestmark = pytest.mark.slow

NARROW = [f"Note {i}: the door code for the garage is 4711 and the gate code is 0815." for i in range(40)]


def test_smollm2_forgets_under_a_narrow_high_lr_window_and_the_guard_rejects_it(smollm2_file, tmp_path):
    recorder = Recorder()
    personaliser = Personaliser(tmp_path, model=str(smollm2_file), lr=1e-2, batch_size=4, seq_len=64,
                                window_steps=6, checkpoint_every=3, holdout_every=4, policy=Policy(check_every_s=0),
                                on_event=recorder, threads=1)
    personaliser.add_many(NARROW)
    result = personaliser.run(max_steps=6)
    built = recorder.of("retain_built")[0]
    answers = [json.loads(line) for line in (tmp_path / "retain" / "answers.jsonl").read_text().splitlines()]
    assert built["prompts"] == len(GENERAL_PROMPTS) and len(answers) == built["answers"] >= len(GENERAL_PROMPTS) - 2
    for record in answers:
        user, assistant = record["messages"]
        assert user["role"] == "user" and assistant["role"] == "assistant"
        assert "<|im_end|>" not in assistant["content"] and "<|im_start|>" not in assistant["content"]
    capital = next(r for r in answers if r["messages"][0]["content"] == "What is the capital of France?")
    assert "Paris" in capital["messages"][1]["content"]
    rejected = recorder.of("rejected")
    assert result.promoted == [] and len(rejected) == 1 and rejected[0]["reason"] == "forgetting"
    figures = rejected[0]
    assert figures["by"] > figures["margin"]  # the user-only gate would have promoted it
    assert figures["retain_worsened"] > figures["retain_margin"] == 0.05
