"""`edgetrain generate` and `edgetrain eval`: a trained adapter changes what the model writes and lowers
its held-out loss; the numbers printed are held_out_loss's; bad values are refused by name."""
from __future__ import annotations

import json
import math

import pytest

import edgetrain
from edgetrain.cli import main

CORPUS = "the device learns where it runs. " * 120


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model's adapter after 10 steps on the corpus (and the corpus file)."""
    directory = tmp_path_factory.mktemp("trained")
    (directory / "train.txt").write_text(CORPUS)
    assert main(["train", "--model", "tiny", "--method", "bp", "--steps", "10", "--seq", "16", "--batch", "2",
                 "--rank", "8", "--lr", "0.05", "--files", str(directory / "train.txt"), "--save-adapter",
                 str(directory / "adapter.safetensors"), "--quiet"]) == 0
    return directory


def _eval(capsys, *flags) -> dict:
    assert main(["eval", "--model", "tiny", "--seq", "32", "--batch", "2", "--quiet", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_adapter_lowers_held_out_loss_and_the_numbers_are_held_out_losss(trained, tmp_path, capsys):
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("it runs where the device learns. " * 40)
    base = _eval(capsys, "--data", str(held_out))
    tuned = _eval(capsys, "--data", str(held_out), "--adapter", str(trained / "adapter.safetensors"))
    # From ln(256) = 5.5 nats (uniform over bytes) the adapter learns the corpus' letters in ten steps.
    assert tuned["loss"] < base["loss"] - 0.4 and tuned["perplexity"] == pytest.approx(math.exp(tuned["loss"]))
    torch_model = edgetrain.load_model("tiny")
    edgetrain.load_lora(torch_model, trained / "adapter.safetensors")
    stream = edgetrain.data.text_stream(32, 2, paths=[held_out], epochs=1)
    assert tuned["loss"] == pytest.approx(edgetrain.held_out_loss(torch_model, stream).loss, rel=1e-12)
    assert tuned["tokens"] == tuned["batches"] * 2 * 32


def test_generate_writes_what_the_adapter_learned(trained, capsys):
    flags = ["generate", "--model", "tiny", "--prompt", "the device ", "--max-tokens", "12", "--quiet"]
    assert main(flags) == 0
    base = capsys.readouterr().out
    assert main([*flags, "--adapter", str(trained / "adapter.safetensors")]) == 0
    tuned = capsys.readouterr().out
    alphabet = set(CORPUS)
    assert sum(c in alphabet for c in tuned.strip()) >= 0.9 * len(tuned.strip())  # the corpus' letters
    assert sum(c in alphabet for c in base.strip()) < 0.5 * len(base.strip())  # not the untrained model's


@pytest.mark.parametrize("flags, message", [
    (["generate", "--prompt", "x", "--max-tokens", "0"], "max_new_tokens must be a whole number >= 1"),
    (["generate", "--prompt", "x", "--temperature", "nan"], "temperature must be a finite number"),
    (["generate", "--prompt", "", ], "prompt is empty"),
    (["generate", "--prompt", "x", "--model", "mlp-digits"], "is not a language model"),
    (["generate", "--prompt", "x", "--adapter", "missing.safetensors"], "missing.safetensors"),
    (["eval", "--data", "missing.txt"], "missing.txt"),
    (["eval", "--data", "{short}"], "too short for one batch"),
    (["eval", "--data", "{short}", "--max-batches", "0"], "--max-batches must be at least 1"),
])
def test_bad_values_are_refused_by_name(tmp_path, capsys, flags, message):
    (tmp_path / "short.txt").write_text("too short")
    argv = [f.format(short=tmp_path / "short.txt") for f in flags]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_mlx_generates_and_evaluates_too(tmp_path, capsys):
    # tests/mlx/test_mlx_generate.py compares MLX's text and loss with torch's on the same GGUF file (the
    # tiny preset's random weights differ between the frameworks).
    pytest.importorskip("mlx.core")
    assert main(["generate", "--backend", "mlx", "--prompt", "the device ", "--max-tokens", "6", "--quiet"]) == 0
    assert capsys.readouterr().out.strip()
    (tmp_path / "held_out.txt").write_text(CORPUS)
    result = _eval(capsys, "--backend", "mlx", "--data", str(tmp_path / "held_out.txt"), "--max-batches", "2")
    assert result["tokens"] == 2 * 2 * 32 and result["perplexity"] == pytest.approx(math.exp(result["loss"]))


# Chats: `--chat --prompt` is one user message, `--messages FILE.jsonl` one conversation a line; both are
# rendered with the model's chat template (or --chat-template) and the reply is the library's
# (tests/models/test_generate_chat.py).

@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    pytest.importorskip("tokenizers")
    from chat_testkit import write_chat_checkpoint

    return write_chat_checkpoint(tmp_path_factory.mktemp("chat") / "ckpt")


def test_generate_chat_replies_to_one_user_message(chat_checkpoint, capsys):
    question = "What is the capital of France?"
    assert main(["generate", "--model", str(chat_checkpoint), "--chat", "--prompt", question, "--max-tokens", "6",
                 "--quiet"]) == 0
    model = edgetrain.load_model(chat_checkpoint)
    assert capsys.readouterr().out == edgetrain.generate(model, [{"role": "user", "content": question}], 6) + "\n"


def test_generate_messages_appends_each_reply_as_an_assistant_message(chat_checkpoint, tmp_path, capsys):
    from chat_testkit import CHAT

    chats = [{"id": "a", "messages": CHAT}, {"messages": [{"role": "user", "content": "Hi!"}]}]
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(chats[0]) + "\n\n" + json.dumps(chats[1]) + "\n")  # a blank line is skipped
    assert main(["generate", "--model", str(chat_checkpoint), "--messages", str(path), "--max-tokens", "5",
                 "--quiet"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    model = edgetrain.load_model(chat_checkpoint)
    replies = [edgetrain.generate(model, chat["messages"], 5) for chat in chats]
    assert lines == [{**chat, "messages": [*chat["messages"], {"role": "assistant", "content": reply}]}
                     for chat, reply in zip(chats, replies)]


def test_generate_chat_template_from_a_string_or_a_file(tmp_path, capsys):
    from chat_testkit import CHATML

    (tmp_path / "chatml.jinja").write_text(CHATML)
    expected = edgetrain.generate(edgetrain.load_model("tiny"), [{"role": "user", "content": "hi"}], 5,
                                  chat_template=CHATML) + "\n"
    for template in (CHATML, str(tmp_path / "chatml.jinja")):
        assert main(["generate", "--chat", "--prompt", "hi", "--chat-template", template, "--max-tokens", "5",
                     "--quiet"]) == 0
        assert capsys.readouterr().out == expected


@pytest.mark.parametrize("flags, lines, message", [
    ([], None, "generate needs exactly one of --prompt"),
    (["--prompt", "x", "--messages", "{chats}"], [], "generate needs exactly one of --prompt"),
    (["--chat", "--messages", "{chats}"], [], "--chat goes with --prompt"),
    (["--prompt", "x", "--chat-template", "{{ 1 }}"], None, "--chat-template applies to chats"),
    (["--chat", "--prompt", "x"], None, "a chat prompt needs a chat template, and the model's tokenizer "
                                        "(ByteTokenizer) has none"),
    (["--chat", "--prompt", "x", "--chat-template", "missing.jinja"], None,
     "missing.jinja: the --chat-template file (and it is no Jinja template) does not exist"),
    (["--messages", "{chats}"], ['{"messages": [{"role": "user", "content": "hi"}]}', "{not json"],
     "chats.jsonl:2: not valid JSON"),
    (["--messages", "{chats}"], ['{"messages": []}'], "chats.jsonl:1: the chat has no messages"),
    (["--messages", "{chats}"], ['{"messages": [{"role": "user"}]}'],
     "chats.jsonl:1: message 0 needs a string 'content'"),
    (["--messages", "{chats}"], ['{"text": "hi"}'], "chats.jsonl:1: a conversation needs a \"messages\" list"),
    (["--messages", "{chats}"], ["", " "], "chats.jsonl: no conversations"),
    (["--messages", "{chats}"], None, "chats.jsonl: the conversations file does not exist"),
])
def test_bad_chat_flags_and_files_are_refused_by_name(tmp_path, capsys, flags, lines, message):
    chats = tmp_path / "chats.jsonl"
    if lines is not None:
        chats.write_text("".join(line + "\n" for line in lines))
    argv = ["generate", "--max-tokens", "2", *(f.replace("{chats}", str(chats)) for f in flags)]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
