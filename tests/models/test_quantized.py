"""Quantised frozen weights on torch (edgetrain/models/quantized.py): packing, GGUF blocks kept as stored,
and every LoRA method's gradients equal to autograd through the dequantised weights."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import edgetrain
from edgetrain.methods import METHODS
from edgetrain.models.lora import LoRALinear
from edgetrain.models.quantize import quantize_linears
from edgetrain.models.quantized import QuantizedLinear, is_quantized
from edgetrain.registry import EdgetrainError


def _dense_twin(model: nn.Module) -> nn.Module:
    """The same model with every QuantizedLinear replaced by an nn.Linear holding its dequantised weight."""
    twin = copy.deepcopy(model)
    for module in list(twin.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, QuantizedLinear):
                dense = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                dense = dense.to(child.scales.dtype)
                with torch.no_grad():
                    dense.weight.copy_(child.dequantize())
                    if child.bias is not None:
                        dense.bias.copy_(child.bias)
                dense.requires_grad_(False)
                setattr(module, name, dense)
    return twin


@pytest.mark.parametrize("bits", [4, 8])
def test_quantising_packs_each_group_within_half_a_step(bits):
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    weight[3, :32] = 0.25  # a constant group is exact
    layer = QuantizedLinear.from_dense(weight, bits)
    assert layer.codes.dtype == torch.uint8 and layer.codes.shape == (8, 64 * bits // 8)
    step = layer.scales.repeat_interleave(32, dim=1)
    error = (layer.dequantize() - weight).abs()
    assert (error <= step / 2 + 1e-6).all()
    assert torch.equal(layer.dequantize()[3, :32], weight[3, :32])
    x = torch.randn(5, 64, dtype=torch.float64)
    torch.testing.assert_close(layer.double()(x), x @ layer.dequantize().T, rtol=0, atol=0)


def test_bad_quantisation_settings_are_named_errors():
    with pytest.raises(EdgetrainError, match="4 or 8 bits"):
        QuantizedLinear.from_dense(torch.randn(4, 32), 3)
    with pytest.raises(EdgetrainError, match="groups of 32"):
        QuantizedLinear.from_dense(torch.randn(4, 48), 4)
    with pytest.raises(EdgetrainError, match="NaN"):
        QuantizedLinear.from_dense(torch.full((4, 32), float("nan")), 4)
    with pytest.raises(EdgetrainError, match="not a GGUF"):
        edgetrain.load_model("tiny", quantized=True)
    with pytest.raises(EdgetrainError, match="not both"):
        edgetrain.load_model("tiny.gguf", quantized=True, quantize_bits=4)


@pytest.mark.parametrize("method", ["bp", "mebp", "mesp", "mezo"])
@pytest.mark.parametrize("bits", [4, 8])
def test_gradients_through_quantised_weights_equal_autograd_through_the_dequantised_ones(method, bits, text_batches):
    torch.manual_seed(0)
    model = edgetrain.load_model("tiny", quantize_bits=bits)
    edgetrain.add_lora(model, rank=4)
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, LoRALinear):
                layer.lora_B.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    assert is_quantized(model)
    dense = _dense_twin(model)
    assert not is_quantized(dense)
    batch = text_batches(1, seq_len=64, batch_size=2)[0]
    loss, grads = METHODS.get(method)(model).gradients(batch)
    reference_loss, reference = METHODS.get("bp" if method != "mezo" else "mezo")(dense).gradients(batch)
    assert abs(float(loss) - float(reference_loss)) <= 1e-5 * abs(float(reference_loss))
    num = sum(float((grads[k] - reference[k]).norm() ** 2) for k in reference) ** 0.5
    den = sum(float(reference[k].norm() ** 2) for k in reference) ** 0.5
    assert num <= 1e-5 * den, (method, num / den)


def test_a_learner_trains_the_adapters_of_a_quantised_model_and_leaves_its_codes_alone(text_batches):
    torch.manual_seed(0)
    model = edgetrain.load_model("tiny", quantize_bits=4)
    edgetrain.add_lora(model, rank=8)
    codes = {name: buffer.clone() for name, buffer in model.named_buffers() if name.endswith("codes")}
    batches = text_batches(6, seq_len=64, batch_size=2)
    learner = edgetrain.Learner(model, method="mesp", optimizer="adamw", lr=3e-3)
    before = learner.evaluate(batches[:2])["loss"]
    for step in range(12):
        learner.step(batches[step % len(batches)])
    assert learner.evaluate(batches[:2])["loss"] < before - 0.05
    assert all(torch.equal(codes[name], buffer) for name, buffer in model.named_buffers() if name in codes)
    with pytest.raises(EdgetrainError, match="quantised base"):
        edgetrain.merge_lora(model)


def test_quantize_linears_replaces_the_block_projections_only():
    torch.manual_seed(0)
    model = edgetrain.load_model("tiny")
    blocks = len(model.blocks)
    assert quantize_linears(model, 8) == 7 * blocks
    assert quantize_linears(model, 8) == 0  # already quantised
    assert type(model.head.lm_head) is nn.Linear and type(model.embed.embed_tokens) is nn.Embedding


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_a_gguf_loads_with_its_blocks_kept_and_the_dequantised_models_logits(tmp_path, ggml_type, arch):
    """llama's Q and K rows reordered as packed rows; qwen2's projection biases beside the packed weights."""
    from gguf_testkit import Q, hf_model, write_gguf

    path = write_gguf(tmp_path / "model.gguf", hf_model(arch), getattr(Q, ggml_type))
    kept = edgetrain.load_model(str(path), quantized=True)
    dense = edgetrain.load_model(str(path))
    assert is_quantized(kept) and not is_quantized(dense)
    layers = [m for m in kept.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(layer.bits == (8 if ggml_type == "Q8_0" else 4) for layer in layers)
    ids = torch.randint(0, dense.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(kept(ids), dense(ids), rtol=0, atol=0)
    held = sum(b.numel() * b.element_size() for b in kept.buffers()) + sum(
        p.numel() * p.element_size() for p in kept.parameters())
    full = sum(p.numel() * p.element_size() for p in dense.parameters())
    assert held < full


@pytest.mark.slow
def test_smollm2_q4_1_kept_packed_gives_the_dequantised_logits_in_a_third_of_the_memory(smollm2_file):
    kept = edgetrain.load_model(str(smollm2_file), quantized=True)
    dense = edgetrain.load_model(str(smollm2_file))
    size = lambda m: sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))  # noqa: E731
    assert size(kept) < 0.4 * size(dense), (size(kept) / 2**20, size(dense) / 2**20)
    ids = torch.from_numpy(np.arange(1, 33).reshape(1, 32))
    with torch.no_grad():
        torch.testing.assert_close(kept(ids), dense(ids), rtol=0, atol=0)
