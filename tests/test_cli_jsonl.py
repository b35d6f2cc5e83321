"""JSONL files through the CLI: `edgetrain train --files x.jsonl` and `edgetrain eval --data x.jsonl`, text
records on the tiny preset, chat records with a checkpoint's own chat template."""
from __future__ import annotations

import json
import math

import pytest
import torch

import edgetrain.data
from edgetrain.cli import main
from edgetrain.data import JsonlStream

COMMON = ["--model", "tiny", "--seq", "16", "--batch", "2", "--quiet"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHAT = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]}


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


@pytest.fixture
def streams(monkeypatch):
    """The streams `edgetrain train` builds."""
    seen, real = [], edgetrain.data.make_stream

    def spy(name, **options):
        seen.append(real(name, **options))
        return seen[-1]
    monkeypatch.setattr(edgetrain.data, "make_stream", spy)
    return seen


def test_train_and_eval_read_text_records(tmp_path, capsys, streams):
    docs = _jsonl(tmp_path / "docs.jsonl", [{"text": f"note {i}: the device learns where it runs."} for i in range(20)])
    assert main(["train", *COMMON, "--method", "bp", "--rank", "2", "--steps", "3", "--files", docs]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["steps_done"] == 3
    assert isinstance(streams[0], JsonlStream) and streams[0].records == 20
    assert main(["eval", *COMMON, "--data", docs]) == 0
    result = json.loads(capsys.readouterr().out)
    assert math.isfinite(result["loss"]) and result["batches"] == streams[0].batches_per_epoch
    expected = sum(int((b.targets != -100).sum()) for b in JsonlStream(docs, seq_len=16, batch_size=2, epochs=1))
    assert result["tokens"] == expected  # padding carries no loss


def test_a_chat_file_for_a_model_without_a_template_is_refused_by_name(tmp_path, capsys):
    chat = _jsonl(tmp_path / "chat.jsonl", [CHAT])
    assert main(["train", *COMMON, "--method", "bp", "--steps", "1", "--files", chat]) == 2
    assert "chat.jsonl:1: a chat record needs a chat template" in capsys.readouterr().err


def _chat_checkpoint(directory):
    """A 2-layer llama checkpoint with a byte-level tokenizer (ChatML markers as ids 256, 257) and a chat template."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from edgetrain.models.llama import LlamaConfig, LlamaModel, edgetrain_key_to_hf

    directory.mkdir()
    shape = dict(vocab_size=258, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(model_type="llama", **shape))
    model.init_weights()
    save_file({edgetrain_key_to_hf(k): v.contiguous() for k, v in model.state_dict().items()
               if k != "head.lm_head.weight"}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", **shape}))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    return directory


def test_train_on_chat_learns_the_assistant_turns_of_the_checkpoints_template(tmp_path, capsys, streams):
    pytest.importorskip("tokenizers")
    checkpoint = _chat_checkpoint(tmp_path / "ckpt")
    chat = _jsonl(tmp_path / "chat.jsonl", [CHAT] * 4)
    assert main(["train", "--model", str(checkpoint), "--method", "bp", "--rank", "2", "--steps", "2", "--seq", "32",
                 "--batch", "2", "--quiet", "--files", chat]) == 0
    batch = streams[0].batch(0)
    learned = [t for t in batch.targets[0].tolist() if t != -100]
    assert streams[0].tokenizer.decode(learned) == "Hi!<|im_end|>" and learned[-1] == 257
