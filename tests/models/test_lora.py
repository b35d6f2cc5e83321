"""LoRA: PEFT parity (forward and autograd gradients), merge/unmerge, adapter save/load."""
from __future__ import annotations

import pytest
import torch

import edgetrain
from edgetrain.models.lora import LoraConfig, lora_layers, lora_state_dict
from edgetrain.training.checkpoint import CorruptCheckpointError

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj",
           "up": "up_proj", "down": "down_proj"}


def _pair(tmp_path, targets=("q", "k", "v", "o", "gate", "up", "down"), rank=4, alpha=8.0):
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=61, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=True)
    hf_model = transformers.Qwen2ForCausalLM(config)
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    ours = edgetrain.load_model(tmp_path)
    edgetrain.add_lora(ours, LoraConfig(rank=rank, alpha=alpha, targets=targets))
    peft_model = peft.get_peft_model(hf_model, peft.LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=[TARGETS[t] for t in targets]))
    # Same init on both sides; B random so gradients of A are not trivially zero.
    generator = torch.Generator().manual_seed(5)
    peft_params = dict(peft_model.named_parameters())
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if not param.requires_grad:
                continue
            layer, _, which = name.rpartition(".")  # blocks.0.self_attn.q_proj, lora_A
            peft_name = ("base_model.model.model.layers." + layer[len("blocks."):]
                         + f".{which}.default.weight")
            value = torch.randn(param.shape, generator=generator) * 0.1
            param.copy_(value)
            peft_params[peft_name].copy_(value)
    return peft_model, ours


@pytest.mark.parametrize("targets", [("q", "k", "v", "o", "gate", "up", "down"), ("q", "v"), ("down",)])
def test_lora_matches_peft_forward_and_gradients(tmp_path, targets):
    peft_model, ours = _pair(tmp_path, targets)
    tokens = torch.randint(0, 61, (2, 12))
    expected = peft_model(tokens).logits
    got = ours(tokens)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    expected.square().mean().backward()
    got.square().mean().backward()
    peft_grads = {n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad}
    trainable = [(n, p) for n, p in ours.named_parameters() if p.requires_grad]
    assert len(trainable) == len(peft_grads) == 2 * 2 * len(targets)
    for name, param in trainable:
        layer, _, which = name.rpartition(".")
        peft_name = "base_model.model.model.layers." + layer[len("blocks."):] + f".{which}.default.weight"
        torch.testing.assert_close(param.grad, peft_grads[peft_name], atol=1e-6, rtol=1e-5)


def test_base_weights_frozen_and_merge_roundtrip(tmp_path):
    _, ours = _pair(tmp_path)
    assert all(("lora_" in n) == p.requires_grad for n, p in ours.named_parameters())
    tokens = torch.randint(0, 61, (1, 10))
    with torch.no_grad():
        before = ours(tokens)
        edgetrain.merge_lora(ours)
        merged = ours(tokens)
        edgetrain.unmerge_lora(ours)
        after = ours(tokens)
    torch.testing.assert_close(merged, before, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


def test_fresh_adapter_leaves_model_unchanged():
    model = edgetrain.load_model("tiny")
    tokens = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        before = model(tokens)
        edgetrain.add_lora(model, rank=4)
        after = model(tokens)
    assert torch.equal(before, after)
    assert len(lora_layers(model)) == 7 * len(model.blocks)


def test_save_and_load_adapter_only(tmp_path):
    _, ours = _pair(tmp_path / "ckpt")
    path = edgetrain.save_lora(ours, tmp_path / "adapter.safetensors")
    fresh = edgetrain.load_model(tmp_path / "ckpt")
    edgetrain.load_lora(fresh, path)
    assert fresh.lora_config == ours.lora_config
    for name, tensor in lora_state_dict(ours).items():
        assert torch.equal(lora_state_dict(fresh)[name], tensor)
    # The adapter file holds adapters only, not the base weights.
    from safetensors import safe_open
    with safe_open(str(path), "pt") as handle:
        assert all("lora_" in k for k in handle.keys())


def test_damaged_adapter_file_is_refused(tmp_path):
    _, ours = _pair(tmp_path / "ckpt")
    path = edgetrain.save_lora(ours, tmp_path / "adapter.safetensors")
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        edgetrain.load_lora(edgetrain.load_model(tmp_path / "ckpt"), path)


def test_bad_lora_config():
    with pytest.raises(edgetrain.EdgetrainError, match="unknown LoRA target"):
        LoraConfig(targets=("q", "fc1"))
    with pytest.raises(edgetrain.EdgetrainError, match="rank"):
        LoraConfig(rank=0)
