"""Chat templates: rendered as Hugging Face renders them, in a sandbox, with the assistant's text located
exactly; and where a tokenizer's template comes from."""
from __future__ import annotations

import json
import logging
import sys

import pytest

from edgetrain.data import ChatTemplate, ChatTemplateError, load_tokenizer
from edgetrain.data.chat_template import chat_template_for, special_token_text
from edgetrain.registry import EdgetrainError

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Llama 3's shape: BOS from the tokenizer, headers, trimmed content, <|eot_id|> ending each turn.
LLAMA3 = ("{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
          "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# ChatML with HF's {% generation %} markers around what the assistant says, and a tojson call.
MARKED = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
          "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
          "{% endgeneration %}{{ '\n' }}{% else %}{{ message['content'] | tojson }}{{ '<|im_end|>\n' }}{% endif %}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHAT = [{"role": "system", "content": "Be brief <b>."}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "  4.  "}, {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6."}]


def _learned(text, spans) -> list[str]:
    return [text[start:end] for start, end in spans]


@pytest.mark.parametrize("template", [CHATML, LLAMA3, MARKED], ids=["chatml", "llama3", "marked"])
def test_rendering_equals_transformers(template):
    chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    for add_generation_prompt in (False, True):
        theirs, _ = chat_utils.render_jinja_template(conversations=[CHAT], chat_template=template,
                                                     add_generation_prompt=add_generation_prompt,
                                                     bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
        mine = ChatTemplate(template, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
        assert mine.render(CHAT, add_generation_prompt=add_generation_prompt) == theirs[0]


def test_assistant_spans_equal_transformers_generation_markers():
    chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    rendered, indices = chat_utils.render_jinja_template(conversations=[CHAT], chat_template=MARKED,
                                                         return_assistant_tokens_mask=True)
    text, spans = ChatTemplate(MARKED).assistant_spans(CHAT)
    assert text == rendered[0] and spans == [tuple(span) for span in indices[0]]


def test_assistant_spans_are_content_and_end_of_turn():
    text, spans = ChatTemplate(CHATML).assistant_spans(CHAT)
    assert _learned(text, spans) == ["  4.  <|im_end|>", "6.<|im_end|>"]  # not the newline after it
    text, spans = ChatTemplate(LLAMA3, bos_token="<|begin_of_text|>").assistant_spans(CHAT)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system")
    assert _learned(text, spans) == ["4.<|eot_id|>", "6.<|eot_id|>"]  # the template trims the content
    # Content that also appears in the prompt is found after the prompt, not in it.
    echo = [{"role": "user", "content": "user"}, {"role": "assistant", "content": "user"}]
    text, spans = ChatTemplate(CHATML).assistant_spans(echo)
    assert spans == [(text.rindex("user<|im_end|>"), len(text) - 1)]
    # ... and after the turn's header, which the generation prompt is.
    header = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "assistant"}]
    text, spans = ChatTemplate(CHATML).assistant_spans(header)
    assert _learned(text, spans) == ["assistant<|im_end|>"] and spans[0][0] == text.rindex("assistant<|im_end|>")


def test_templates_that_hide_the_assistant_text_or_fail_are_named():
    rewrites = "{% for m in messages %}{{ m['role'] }}{% if loop.last %}:{{ m['content'] }}{% endif %}|{% endfor %}"
    with pytest.raises(ChatTemplateError, match="renders earlier turns differently"):
        ChatTemplate(rewrites).assistant_spans(CHAT)
    hides = "{% for m in messages %}{{ m['role'] }}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}" \
            "{% endfor %}"
    with pytest.raises(ChatTemplateError, match="does not render the assistant's content verbatim"):
        ChatTemplate(hides).assistant_spans(CHAT)
    with pytest.raises(ChatTemplateError, match=r"does not compile: .*template line 1"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="non-empty Jinja string"):
        ChatTemplate("  ")
    with pytest.raises(ChatTemplateError, match="the chat template failed: .*str"):  # a TypeError inside
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render(CHAT)


def test_end_of_turn_is_the_text_that_closes_an_assistant_turn():
    assert ChatTemplate(CHATML).end_of_turn() == "<|im_end|>"  # not the newline after it
    assert ChatTemplate(LLAMA3, bos_token="<|begin_of_text|>").end_of_turn() == "<|eot_id|>"
    assert ChatTemplate(MARKED).end_of_turn() == "<|im_end|>"
    # Llama 2's shape: a space, then the tokenizer's EOS.
    llama2 = ("{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% else %}"
              " {{ m['content'] }} {{ eos_token }}{% endif %}{% endfor %}")
    assert ChatTemplate(llama2, eos_token="</s>").end_of_turn() == "</s>"
    assert ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}").end_of_turn() is None
    hides = "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="does not render the assistant's content verbatim"):
        ChatTemplate(hides).end_of_turn()


def test_templates_run_in_a_sandbox():
    escape = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ChatTemplateError, match="the chat template failed"):
        ChatTemplate(escape).render(CHAT)
    mutate = "{% set _ = messages.append(1) %}{{ messages | length }}"
    with pytest.raises(ChatTemplateError, match="the chat template failed"):
        ChatTemplate(mutate).render(CHAT)


def test_missing_jinja2_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "jinja2", None)
    with pytest.raises(EdgetrainError, match="needs the 'jinja2' package: pip install jinja2"):
        ChatTemplate(CHATML)


def _tokenizer_dir(directory, files: dict):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models

    directory.mkdir()
    tokenizer = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "<s>": 1, "</s>": 2}, unk_token="[UNK]"))
    tokenizer.save(str(directory / "tokenizer.json"))
    for name, content in files.items():
        (directory / name).write_text(content)
    return directory


def test_where_a_checkpoint_keeps_its_template(tmp_path, caplog):
    config = {"chat_template": CHATML, "bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>"}
    plain = load_tokenizer(_tokenizer_dir(tmp_path / "plain", {"tokenizer_config.json": json.dumps(config)}))
    assert plain.chat_template == CHATML and (plain.bos_token, plain.eos_token) == ("<s>", "</s>")
    assert (plain.bos_token_id, plain.eos_token_id, plain.pad_token_id) == (1, 2, None)
    templates = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": LLAMA3}]
    named = load_tokenizer(_tokenizer_dir(tmp_path / "named", {"tokenizer_config.json": json.dumps(
        {**config, "chat_template": templates})}))
    assert named.chat_template == LLAMA3
    beside = load_tokenizer(_tokenizer_dir(tmp_path / "jinja", {"tokenizer_config.json": json.dumps(config),
                                                                 "chat_template.jinja": LLAMA3}))
    assert beside.chat_template == LLAMA3
    assert load_tokenizer(_tokenizer_dir(tmp_path / "none", {})).chat_template is None
    with caplog.at_level(logging.WARNING, logger="edgetrain"):
        damaged = load_tokenizer(_tokenizer_dir(tmp_path / "damaged", {"tokenizer_config.json": "{"}))
    assert damaged.chat_template is None and "cannot read it" in caplog.text
    template = chat_template_for(plain)
    assert template is not None and template.render([{"role": "user", "content": "hi"}]).startswith("<|im_start|>")
    assert chat_template_for(damaged) is None and chat_template_for(damaged, CHATML).source == CHATML


def test_special_token_text_from_names_or_ids():
    class GGUFLike:  # what a GGUFTokenizer keeps: ids, no names
        bos_token_id, eos_token_id = 1, None

        def decode(self, ids):
            return {1: "<|im_start|>"}[ids[0]]

    assert special_token_text(GGUFLike(), "bos") == "<|im_start|>" and special_token_text(GGUFLike(), "eos") is None
    template = "{{ bos_token }}|{{ eos_token }}"
    assert ChatTemplate(template, bos_token="<b>").render(CHAT) == "<b>|"  # undefined eos renders as nothing
