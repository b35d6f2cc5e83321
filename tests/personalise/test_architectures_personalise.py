"""Today's architectures in the personaliser and in chat: the Llama 3.x, Qwen3 and Gemma 3 fixtures (tests/fixtures/arch, their
GGUFs made by llama.cpp's converter with each model's chat template) render chats as transformers does, stop a
reply at the model's own end of turn, and a personaliser window on each trains, evaluates and gates with both
figures in the event, its retain set answered through that template."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import edgetrain
import edgetrain.models.generate as generation
from edgetrain.data.chat_prompt import chat_prompt
from personalise_kit import Recorder, english_texts, make

import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chat_testkit import spy_on_generate_ids  # noqa: E402

ARCH = Path(__file__).resolve().parents[1] / "fixtures" / "arch"
# The fixtures whose tokenizer carries a chat template, and the end of turn that template writes.
END_OF_TURN = {"llama3": "<|eot_id|>", "qwen3": "<|im_end|>", "gemma3": "<end_of_turn>"}
CHATTY = sorted(END_OF_TURN)
CHAT = [{"role": "user", "content": "What is my cat called?"}]


@pytest.mark.parametrize("name", CHATTY)
def test_a_chat_renders_as_transformers_renders_it_and_stops_at_the_models_end_of_turn(name, monkeypatch):
    transformers = pytest.importorskip("transformers")
    model = edgetrain.load_model(ARCH / f"{name}.gguf")
    theirs = transformers.AutoTokenizer.from_pretrained(ARCH / name)
    expected = theirs.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert chat_prompt(model.tokenizer, CHAT).ids == list(expected)
    end_of_turn = model.tokenizer.encode(END_OF_TURN[name])
    assert len(end_of_turn) == 1
    spy = spy_on_generate_ids(monkeypatch, generation)
    bias = torch.zeros(model.config.vocab_size)
    bias[end_of_turn[0]] = 1e4  # greedy decoding writes the end of turn first
    model.head.lm_head.bias = torch.nn.Parameter(bias, requires_grad=False)
    assert edgetrain.generate(model, CHAT, 8) == ""
    assert spy[-1]["produced"] == end_of_turn and end_of_turn[0] in spy[-1]["stop_ids"]


@pytest.mark.parametrize("name", CHATTY)
def test_a_personaliser_window_trains_evaluates_and_gates_with_both_figures(name, tmp_path):
    recorder = Recorder()
    personaliser = make(tmp_path / "store", str(ARCH / f"{name}.gguf"), on_event=recorder, threads=1,
                        retain_margin=0.05, lr=1e-3)
    personaliser.add_many(english_texts(16) + [{"messages": [
        {"role": "user", "content": "What is my cat called?"}, {"role": "assistant", "content": "Miso."}]}])
    result = personaliser.run(max_steps=6)
    assert result.windows == 1 and len(result.promoted) + result.rejected == 1
    evaluated = recorder.of("evaluated")[0]
    for figure in ("value", "reference", "retain", "retain_base"):
        assert evaluated[figure] > 0, figure
    assert recorder.of("retain_built")[0]["answers"] > 0
    # The retain set is the base's own answers to chat prompts, scored through the model's template.
    rows = [json.loads(line) for line in (tmp_path / "store" / "retain" / "answers.jsonl").read_text().splitlines()]
    assert rows and all([m["role"] for m in row["messages"]] == ["user", "assistant"] for row in rows)
