"""Chat generation on MLX: the same prompt ids and stops as torch (edgetrain.data.chat_prompt, reached through
the shared continue_text), the same reply from the same checkpoint, the stop at the template's end of turn left
out of the text, and a chat without a template refused by name; `edgetrain generate --backend mlx --chat` too."""
from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install edgetrain[mlx])")
pytest.importorskip("tokenizers")

import edgetrain  # noqa: E402
from edgetrain.backends.mlx import generate as mlx_generate  # noqa: E402
from edgetrain.backends.mlx.loading import load_mlx_model  # noqa: E402
from edgetrain.cli import main  # noqa: E402
from edgetrain.data.chat_prompt import chat_prompt  # noqa: E402
from edgetrain.data.chat_template import ChatTemplateError  # noqa: E402
from edgetrain.models.generate import generate  # noqa: E402

from chat_testkit import CHAT, EOS, IM_END, write_chat_checkpoint, spy_on_generate_ids  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_chat_checkpoint(tmp_path_factory.mktemp("chat") / "ckpt")


@pytest.fixture
def spy(monkeypatch):
    """What MLX's generate hands its generate_ids: prompt ids, stops, and the ids that came back."""
    return spy_on_generate_ids(monkeypatch, mlx_generate)


def test_mlx_renders_the_chat_as_torch_does_and_writes_the_same_reply(checkpoint, spy):
    mlx_model = edgetrain.load_model(checkpoint, backend="mlx")
    torch_model = edgetrain.load_model(checkpoint)
    reply = generate(mlx_model, CHAT, 8)
    expected = chat_prompt(torch_model.tokenizer, CHAT)
    assert spy[-1]["prompt_ids"] == expected.ids and set(spy[-1]["stop_ids"]) == {EOS, IM_END}
    assert reply == generate(torch_model, CHAT, 8)


def test_mlx_stops_at_the_end_of_turn_and_leaves_it_out(checkpoint, spy, monkeypatch):
    model = edgetrain.load_model(checkpoint, backend="mlx")
    logits = model.logits
    bias = mx.zeros((model.config.vocab_size,)).at[IM_END].add(1e4)  # greedy picks <|im_end|> every step
    monkeypatch.setattr(model, "logits", lambda hidden: logits(hidden) + bias)
    assert generate(model, CHAT, 8) == ""
    assert spy[-1]["produced"] == [IM_END]
    assert generate(model, "Hi", 3) == "<|im_end|>" * 3  # a plain prompt stops at EOS only


def test_mlx_stops_at_an_end_of_turn_of_several_tokens(monkeypatch, spy):
    model = load_mlx_model("tiny")  # the byte tokenizer: the end of turn "##" is two tokens
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}##\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")
    logits = model.logits
    bias = mx.zeros((model.config.vocab_size,)).at[ord("#")].add(1e4)
    monkeypatch.setattr(model, "logits", lambda hidden: logits(hidden) + bias)
    assert generate(model, CHAT, 8, chat_template=template) == ""
    assert spy[-1]["produced"] == list(b"##")


def test_mlx_refuses_a_chat_without_a_template():
    with pytest.raises(ChatTemplateError, match=r"needs a chat template, and the model's tokenizer \(ByteTok"):
        generate(load_mlx_model("tiny"), CHAT, 4)


def test_cli_chat_on_mlx_prints_torchs_reply(checkpoint, capsys):
    flags = ["generate", "--model", str(checkpoint), "--chat", "--prompt", CHAT[1]["content"], "--max-tokens", "6",
             "--quiet"]
    assert main([*flags, "--backend", "mlx"]) == 0
    mlx_out = capsys.readouterr().out
    assert main(flags) == 0
    assert mlx_out == capsys.readouterr().out
