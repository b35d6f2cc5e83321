"""A small Instruct-style checkpoint for chat generation tests: a 2-layer llama whose byte-level tokenizer has
ChatML's markers as special tokens and whose tokenizer_config.json carries a ChatML template. Its EOS is
`<|endoftext|>`, not the template's end of turn `<|im_end|>`, so the two stops can be told apart.
Shared by tests/models/test_generate_chat.py, tests/mlx/test_mlx_generate_chat.py and the CLI tests."""
from __future__ import annotations

import json
from pathlib import Path

import torch

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
IM_START, IM_END, EOS = 256, 257, 258  # their ids, after the 256 byte tokens
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
SHAPE = dict(vocab_size=259, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=True)


def write_chat_checkpoint(directory: Path, template: str | None = CHATML) -> Path:
    """The checkpoint in `directory` (made here); `template` None leaves the chat template out."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from edgetrain.models.llama import LlamaConfig, LlamaModel, edgetrain_key_to_hf

    directory.mkdir(parents=True)
    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(model_type="llama", **SHAPE))
    model.init_weights()
    save_file({edgetrain_key_to_hf(k): v.contiguous() for k, v in model.state_dict().items()
               if k != "head.lm_head.weight"}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", **SHAPE}))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>", **({} if template is None else {"chat_template": template})}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def spy_on_generate_ids(monkeypatch, module) -> list[dict]:
    """Record what `module`'s generate_ids is handed (prompt ids, stops) and the ids it returns, call by call."""
    calls: list[dict] = []
    real = module.generate_ids

    def recording(model, prompt_ids, max_new_tokens, **options):
        produced = real(model, prompt_ids, max_new_tokens, **options)
        calls.append(dict(prompt_ids=list(prompt_ids), produced=produced, **options))
        return produced
    monkeypatch.setattr(module, "generate_ids", recording)
    return calls
