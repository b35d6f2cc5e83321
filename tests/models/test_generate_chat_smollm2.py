"""Chat-aware generation on a real Instruct model (slow lane: SmolLM2-135M-Instruct's GGUF, packed): the
chat is rendered with the GGUF's own template (its default system turn included, as transformers renders
it), the reply ends at `<|im_end|>` well before the token cap, and the batched greedy answers the retain
set uses are the same replies."""
from __future__ import annotations

import pytest

import edgetrain
from edgetrain.data.chat_prompt import chat_prompt
from edgetrain.data.tokenizer import model_tokenizer
from edgetrain.models.generate import generate, generate_ids
from edgetrain.models.generate_batch import greedy_answers

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "How many legs does a spider have?", "Say hello in Spanish."]


def test_smollm2_answers_a_chat_in_its_template_and_stops_at_the_end_of_turn(smollm2_file):
    model = edgetrain.load_model(smollm2_file)
    tokenizer = model_tokenizer(model)
    request = chat_prompt(tokenizer, [{"role": "user", "content": QUESTIONS[0]}])
    assert tokenizer.decode(request.ids).endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                                                  "<|im_start|>assistant\n")
    assert "<|im_start|>system" in tokenizer.decode(request.ids)
    ids = generate_ids(model, request.ids, 64, stop_ids=request.stop_ids)
    assert ids[-1] in request.stop_ids and len(ids) < 64  # it said it was done
    reply = generate(model, [{"role": "user", "content": QUESTIONS[0]}], 64)
    assert "Paris" in reply and "<|im_end|>" not in reply and reply == tokenizer.decode(request.reply(ids))
    # The retain set's batched answers are these replies, one batch for every question.
    requests = [chat_prompt(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    batched = greedy_answers(model, [r.ids for r in requests], 48, stop_ids=request.stop_ids, pad_id=2)
    for answer, single in zip(batched, requests):
        alone = generate_ids(model, single.ids, 48, stop_ids=single.stop_ids)
        assert answer == single.reply(alone)
