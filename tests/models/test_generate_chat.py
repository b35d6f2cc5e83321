"""Chat generation on torch: a list of messages is rendered with the model's chat template ready for the
assistant's turn (the ids transformers' apply_chat_template gives), and the reply stops at the template's end
of turn as well as at EOS, the stop left out of the text; an end of turn of several tokens stops as a
sequence; a chat without a template, or a malformed one, is refused by name; a plain prompt is as before."""
from __future__ import annotations

import pytest
import torch

import edgetrain
import edgetrain.models.generate as generation
from edgetrain.data.chat_prompt import GenerationPrompt, chat_prompt
from edgetrain.data.chat_template import ChatMessageError, ChatTemplate, ChatTemplateError
from edgetrain.data.tokenizer import ByteTokenizer
from edgetrain.models.generate import decode_loop, generate, generate_ids

from chat_testkit import CHAT, CHATML, EOS, IM_END, write_chat_checkpoint, spy_on_generate_ids

pytest.importorskip("tokenizers")
# A template whose end of turn, "##", is two tokens of the byte tokenizer.
HASHES = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}##\n{% endfor %}"
          "{% if add_generation_prompt %}assistant: {% endif %}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_chat_checkpoint(tmp_path_factory.mktemp("chat") / "ckpt")


@pytest.fixture
def spy(monkeypatch):
    """What generate() hands generate_ids: prompt ids, stops, and the ids that came back."""
    return spy_on_generate_ids(monkeypatch, generation)


def _force(model, token: int) -> None:
    """Greedy decoding picks `token` at every step: a large bias on its logit."""
    bias = torch.zeros(model.config.vocab_size, dtype=model.head.lm_head.weight.dtype)
    bias[token] = 1e4
    model.head.lm_head.bias = torch.nn.Parameter(bias, requires_grad=False)


def test_the_prompt_is_the_templates_rendering_with_the_generation_prompt(checkpoint, spy):
    model = edgetrain.load_model(checkpoint)
    rendered = ChatTemplate(CHATML).render(CHAT, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    expected = model.tokenizer.encode(rendered)
    assert chat_prompt(model.tokenizer, CHAT).ids == expected
    generate(model, CHAT, 4)
    assert spy[-1]["prompt_ids"] == expected
    assert set(spy[-1]["stop_ids"]) == {EOS, IM_END}  # EOS and the end of turn, each one token here
    transformers = pytest.importorskip("transformers")
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"))
    ids = theirs.apply_chat_template(CHAT, chat_template=CHATML, add_generation_prompt=True, tokenize=True)
    assert expected == (ids["input_ids"] if hasattr(ids, "keys") else ids)  # newer releases return a BatchEncoding


def test_a_chat_reply_stops_at_the_end_of_turn_and_leaves_it_out(checkpoint, spy):
    model = edgetrain.load_model(checkpoint)
    _force(model, IM_END)
    assert generate(model, CHAT, 8) == ""
    assert spy[-1]["produced"] == [IM_END]
    # A plain prompt stops at EOS only: the same model writes the end-of-turn token on and on.
    assert generate(model, "Hi", 3) == "<|im_end|>" * 3


def test_a_chat_reply_stops_at_eos_too(checkpoint, spy):
    model = edgetrain.load_model(checkpoint)
    _force(model, EOS)
    assert generate(model, CHAT, 8) == ""
    assert spy[-1]["produced"] == [EOS]


def test_an_end_of_turn_of_several_tokens_stops_as_a_sequence(spy):
    prompt = chat_prompt(ByteTokenizer(), CHAT, HASHES)
    assert prompt.stop_ids == () and prompt.stop_sequences == (tuple(b"##"),)
    model = edgetrain.load_model("tiny")  # the byte tokenizer, no chat template of its own
    _force(model, ord("#"))
    assert generate(model, CHAT, 8, chat_template=HASHES) == ""
    assert spy[-1]["produced"] == list(b"##")
    assert generate(model, "Hi", 8) == "#" * 8


def test_the_decoding_loop_stops_after_a_whole_stop_sequence():
    script = iter([5, 7, 9, 7, 8, 3, 3])

    def next_logits(ids):
        return torch.nn.functional.one_hot(torch.tensor(next(script)), 16).double()
    produced = decode_loop(next_logits, [1], 10, temperature=0.0, top_p=1.0, seed=0, stop_ids=[],
                           stop_sequences=[[7, 8]])
    assert produced == [5, 7, 9, 7, 8]  # 7 then 9 is not the sequence
    assert GenerationPrompt([1], (), ((7, 8),)).reply(produced) == [5, 7, 9]
    assert GenerationPrompt([1], (3,), ()).reply([5, 3]) == [5]
    assert GenerationPrompt([1], (3,), ((7, 8),)).reply([5, 7]) == [5, 7]  # cut by max_new_tokens: all kept


def test_the_template_can_be_given_and_a_plain_prompt_is_as_before(checkpoint, spy):
    model = edgetrain.load_model(checkpoint)
    assert generate(model, "Hi", 4) == model.tokenizer.decode(generate_ids(model, model.tokenizer.encode("Hi"), 4,
                                                                              stop_ids=[EOS]))
    assert spy[0]["prompt_ids"] == model.tokenizer.encode("Hi") and list(spy[0]["stop_ids"]) == [EOS]
    other = CHATML.replace("'\n'", "'\n\n'")
    generate(model, CHAT, 2, chat_template=other)
    assert spy[-1]["prompt_ids"] == model.tokenizer.encode(ChatTemplate(other).render(CHAT, True))


def test_a_chat_for_a_model_without_a_template_is_refused_by_name(tmp_path):
    with pytest.raises(ChatTemplateError, match=r"a chat prompt needs a chat template, and the model's tokenizer "
                                                r"\(ByteTokenizer\) has none"):
        generate(edgetrain.load_model("tiny"), CHAT, 4)
    bare = edgetrain.load_model(write_chat_checkpoint(tmp_path / "bare", template=None))
    with pytest.raises(ChatTemplateError, match=r"\(HFTokenizer\) has none"):
        generate(bare, CHAT, 4)
    with pytest.raises(ChatTemplateError, match="chat_template= applies to a chat prompt"):
        generate(bare, "Hi", 4, chat_template=CHATML)


@pytest.mark.parametrize("messages, message", [
    ([], "the prompt: the chat has no messages"),
    ({"role": "user", "content": "hi"}, "the prompt: a chat must be a list of messages, got dict"),
    (None, "got NoneType"),
    ([("user", "hi")], "message 0 must be a dict"),
    ([{"role": "user", "content": "hi"}, {"role": "user"}], "message 1 needs a string 'content', got NoneType"),
    ([{"role": 1, "content": "hi"}], "message 0 needs a string 'role', got int"),
])
def test_malformed_chats_are_refused_by_name(checkpoint, messages, message):
    with pytest.raises(ChatMessageError, match=message):
        generate(edgetrain.load_model(checkpoint), messages, 4)
