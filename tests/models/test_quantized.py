"""Quantised frozen weights on torch (edgetrain/models/quantized.py): packing, GGUF blocks kept as stored,
and every LoRA method's gradients equal to autograd through the dequantised weights."""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

import edgetrain
from edgetrain.methods import METHODS
from edgetrain.models import quantized
from edgetrain.models.lora import LoRALinear
from edgetrain.models.quantize import quantize_base, quantize_linears
from edgetrain.models.quantized import QuantizedEmbedding, QuantizedLinear, TiedQuantizedHead, is_quantized
from edgetrain.registry import EdgetrainError
from quantized_testkit import dense_twin as _dense_twin


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
    with pytest.raises(EdgetrainError, match="quantize_bits must be one of"):
        edgetrain.load_model("tiny", quantize_bits=5)
    with pytest.raises(EdgetrainError, match="options= or the dtype"):
        edgetrain.load_model("tiny", quantize_bits=4, options=edgetrain.LoadOptions())
    with pytest.raises(EdgetrainError, match="4 or 8 bits"):  # torch's quantiser names what it supports
        edgetrain.load_model("tiny", quantize_bits=2)


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


def test_a_learner_checkpoint_of_a_quantised_model_leaves_the_packed_base_out(tmp_path, text_batches):
    """The packed codes and scales are frozen base weights: they come from the base, as dense ones do."""
    from safetensors import safe_open

    def learner() -> edgetrain.Learner:
        torch.manual_seed(0)
        model = edgetrain.load_model("tiny", quantize_bits=4)
        edgetrain.add_lora(model, rank=8)
        return edgetrain.Learner(model, method="mesp", optimizer="adamw", lr=3e-3)

    batches = text_batches(3, seq_len=32, batch_size=2)
    trained = learner()
    trained.step(batches[0])
    path = trained.save(tmp_path / "ckpt.safetensors")
    with safe_open(str(path), "pt") as handle:
        keys = list(handle.keys())
    assert not [k for k in keys if k.endswith((".codes", ".scales", ".biases"))]
    assert any(k.startswith("param/") and "lora" in k for k in keys)
    resumed = learner().load(path)
    for batch in batches[1:]:
        assert resumed.step(batch).loss == trained.step(batch).loss


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
    dense = edgetrain.load_model(str(path), quantized=False)
    assert is_quantized(kept) and not is_quantized(dense)
    layers = [m for m in kept.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(layer.bits == (8 if ggml_type == "Q8_0" else 4) for layer in layers)
    # Q4_0 and Q8_0 are symmetric: their bias is computed from the zero point, not stored.
    zero_point = {"Q4_0": 8, "Q8_0": 128}.get(ggml_type)
    assert all(layer.zero_point == zero_point and (layer.biases is None) == (zero_point is not None)
               for layer in layers)
    ids = torch.randint(0, dense.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(kept(ids), dense(ids), rtol=0, atol=0)
        # A cast and a copy keep the computed bias (nothing to move or round).
        torch.testing.assert_close(copy.deepcopy(kept).double()(ids), dense.double()(ids), rtol=1e-10, atol=1e-12)
    held = sum(b.numel() * b.element_size() for b in kept.buffers()) + sum(
        p.numel() * p.element_size() for p in kept.parameters())
    full = sum(p.numel() * p.element_size() for p in dense.parameters())
    assert held < full


@pytest.mark.slow
def test_smollm2_q4_1_kept_packed_gives_the_dequantised_logits_in_a_third_of_the_memory(smollm2_file):
    kept = edgetrain.load_model(str(smollm2_file), quantized=True)
    dense = edgetrain.load_model(str(smollm2_file), quantized=False)
    size = lambda m: sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))  # noqa: E731
    assert size(kept) < 0.4 * size(dense), (size(kept) / 2**20, size(dense) / 2**20)
    ids = torch.from_numpy(np.arange(1, 33).reshape(1, 32))
    with torch.no_grad():
        torch.testing.assert_close(kept(ids), dense(ids), rtol=0, atol=0)


def _untied_tiny() -> nn.Module:
    from edgetrain.models.llama import LlamaConfig, LlamaModel

    config = dataclasses.replace(edgetrain.load_model("tiny").config, tie_word_embeddings=False)
    model = LlamaModel(config)
    model.init_weights(seed=3)
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_quantize_base_packs_the_embedding_and_head_and_a_tied_head_reads_the_embeddings_table(tied):
    torch.manual_seed(0)
    model = edgetrain.load_model("tiny") if tied else _untied_tiny()
    dense = copy.deepcopy(model)
    assert quantize_base(model, 8) == 7 * len(model.blocks) + (1 if tied else 2)
    table, head = model.embed.embed_tokens, model.head.lm_head
    assert isinstance(table, QuantizedEmbedding)
    assert isinstance(head, TiedQuantizedHead if tied else QuantizedLinear)
    if tied:
        assert head.table is table and not list(head.buffers())  # one table, held once
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(table(ids), table.dequantize()[ids], rtol=0, atol=0)
    assert table.group_size == 64  # the load default where the width allows (MLX's)
    step = table.scales.float().repeat_interleave(table.group_size, dim=1)
    assert ((table.dequantize() - dense.embed.embed_tokens.weight).abs() <= step / 2 + 1e-3).all()
    x = torch.randn(2, 9, model.config.hidden_size)
    torch.testing.assert_close(head(x), x @ head.weight.T, rtol=1e-6, atol=1e-6)
    twin = copy.deepcopy(model)
    if tied:
        assert twin.head.lm_head.table is twin.embed.embed_tokens
    with pytest.raises(EdgetrainError, match=r"token ids must lie in \[0, 256\)"):
        table(torch.tensor([[0, 256]]))


def test_large_matrices_are_dequantised_in_tiles_with_the_same_product_gradient_and_jvp(monkeypatch):
    import edgetrain.models.quantized as quantized

    weight = torch.randn(40, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    layer = QuantizedLinear.from_dense(weight, 4).double()
    x = torch.randn(3, 5, 64, dtype=torch.float64, requires_grad=True)
    tangent = torch.randn_like(x)
    whole = layer(x)
    (whole_grad,) = torch.autograd.grad(whole.square().sum(), x)
    _, whole_jvp = torch.func.jvp(layer, (x.detach(),), (tangent,))
    seen = []
    original = quantized.PackedMatrix.dequantize_rows
    for constant in ("TILE_ELEMENTS", "KERNEL_TILE_ELEMENTS"):  # 7 rows a tile: 6 tiles, the last short
        monkeypatch.setattr(quantized, constant, 64 * 7)
    monkeypatch.setattr(quantized.PackedMatrix, "dequantize_rows",
                        lambda self, start, stop, *a, **k: seen.append(stop - start) or original(self, start, stop, *a, **k))
    tiled = layer(x)
    (tiled_grad,) = torch.autograd.grad(tiled.square().sum(), x)
    _, tiled_jvp = torch.func.jvp(layer, (x.detach(),), (tangent,))
    assert max(seen) == 7 and 40 % 7 in seen
    for got, want in [(tiled, whole), (tiled_grad, whole_grad), (tiled_jvp, whole_jvp)]:
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_gpu_dequantises_in_larger_tiles_than_a_cpu():
    """A CPU's tiles fit its cache (twice as large with the compiled tile kernel, whose tiles cost less than
    the work around them); another device's are 16x larger (fewer kernel launches). The meta device stands in
    for a GPU here (tests/test_cuda.py checks a real one)."""
    from edgetrain.models import tile_kernel

    layer = QuantizedLinear.from_dense(torch.randn(2048, 1024), 4)
    assert quantized.tile_elements("cpu") == quantized.KERNEL_TILE_ELEMENTS == 2 * quantized.TILE_ELEMENTS
    assert [stop - start for start, stop, _ in layer.scratch_tiles()] == [512] * 4
    with tile_kernel.kernel_enabled(False):
        assert quantized.tile_elements("cpu") == quantized.TILE_ELEMENTS
        assert [stop - start for start, stop, _ in layer.scratch_tiles()] == [256] * 8
    assert quantized.tile_elements("cuda") == quantized.ACCELERATOR_TILE_ELEMENTS == 16 * quantized.TILE_ELEMENTS
    assert [stop - start for start, stop, _ in layer.scratch_tiles(device="meta")] == [2048]


def test_a_dtype_cast_sets_the_compute_dtype_and_never_rounds_the_stored_scales():
    torch.manual_seed(0)
    layer = QuantizedLinear.from_dense(torch.randn(16, 64) * 3, 4)
    assert layer.scales.dtype == torch.float16 and layer.dtype == torch.float32
    scales, reference = layer.scales.clone(), layer.dequantize()
    layer.to(torch.bfloat16)
    assert layer.dtype == torch.bfloat16 and layer.scales.dtype == torch.float16
    assert torch.equal(layer.scales, scales)
    assert layer.dequantize().dtype == torch.bfloat16
    torch.testing.assert_close(layer.dequantize(torch.float32), reference, rtol=0, atol=0)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert layer(x).dtype == torch.bfloat16
    layer.double()
    assert layer.dequantize().dtype == torch.float64 and torch.equal(layer.dequantize().float(), reference)


def test_a_symmetric_layer_holds_a_zero_point_in_range_and_fewer_bytes():
    with pytest.raises(EdgetrainError, match="zero point"):
        QuantizedLinear(32, 4, 4, zero_point=16)
    with pytest.raises(EdgetrainError, match="zero point"):
        QuantizedLinear(32, 4, 8, zero_point=1.5)
    symmetric, affine = QuantizedLinear(64, 4, 8, zero_point=128), QuantizedLinear(64, 4, 8)
    assert symmetric.biases is None and "biases" not in symmetric.state_dict()
    assert symmetric.packed_bytes() == affine.packed_bytes() - affine.biases.numel() * affine.biases.element_size()
    symmetric.codes.fill_(130)
    symmetric.scales.fill_(0.5)
    assert torch.equal(symmetric.dequantize(), torch.ones(4, 64))  # 0.5 * (130 - 128)


def test_scales_beyond_float16s_range_are_kept_in_float32():
    weight = torch.randn(4, 32) * 1e6
    layer = QuantizedLinear.from_dense(weight, 8)
    assert layer.scales.dtype == torch.float32
    step = layer.scales.repeat_interleave(32, dim=1)
    assert ((layer.dequantize() - weight).abs() <= step / 2 * 1.001).all()


@pytest.mark.parametrize("tied", [True, False])
def test_a_gguf_keeps_its_embedding_and_head_packed_with_the_dense_logits(tmp_path, tied):
    from gguf_testkit import Q, hf_model, write_gguf

    path = write_gguf(tmp_path / "model.gguf", hf_model("llama", tie=tied), Q.Q8_0)
    kept = edgetrain.load_model(str(path), quantized=True)
    dense = edgetrain.load_model(str(path), quantized=False)
    assert isinstance(kept.embed.embed_tokens, QuantizedEmbedding) and kept.embed.embed_tokens.bits == 8
    assert isinstance(kept.head.lm_head, TiedQuantizedHead if tied else QuantizedLinear)
    assert kept.embed.embed_tokens.scales.dtype == torch.float16  # the file's f16 scales, exact
    ids = torch.randint(0, dense.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(kept(ids), dense(ids), rtol=0, atol=0)
    edgetrain.add_lora(kept, rank=4)
    edgetrain.add_lora(dense, rank=4)
    dense.load_state_dict({k: v for k, v in kept.state_dict().items() if "lora" in k}, strict=False)
    batch = edgetrain.data.batch.Batch(ids[:, :-1], ids[:, 1:])
    loss, grads = METHODS.get("mesp")(kept).gradients(batch)
    reference_loss, reference = METHODS.get("bp")(dense).gradients(batch)
    torch.testing.assert_close(loss, reference_loss, rtol=1e-5, atol=0)
    for name in reference:
        torch.testing.assert_close(grads[name], reference[name], rtol=1e-4, atol=1e-6)


def test_mesp_dequantises_projections_and_the_head_in_tiles_with_autograds_gradients(monkeypatch, text_batches):
    """Tiles small enough that every projection and the head are cut (the last tile short): the same
    loss and gradients as bp through the dequantised weights, and no tile above the bound."""
    import edgetrain.methods.mesp.loss as mesp_loss
    import edgetrain.models.quantized as quantized
    from edgetrain.models.quantized import PackedMatrix

    torch.manual_seed(0)
    model = edgetrain.load_model("tiny", quantize_bits=4)
    edgetrain.add_lora(model, rank=4)
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, LoRALinear):
                layer.lora_B.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    dense = _dense_twin(model)
    batch = text_batches(1, seq_len=64, batch_size=2)[0]
    tiles = []
    original = PackedMatrix.dequantize_rows
    monkeypatch.setattr(PackedMatrix, "dequantize_rows",
                        lambda self, start, stop, *a, **k: tiles.append((self.rows, (stop - start) * self.cols))
                        or original(self, start, stop, *a, **k))
    original_tiles = PackedMatrix.scratch_tiles

    def recorded_tiles(self, *args, **kwargs):  # the compiled kernel's tiles do not pass dequantize_rows
        for start, stop, tile in original_tiles(self, *args, **kwargs):
            tiles.append((self.rows, tile.numel()))
            yield start, stop, tile

    monkeypatch.setattr(PackedMatrix, "scratch_tiles", recorded_tiles)
    for constant in ("TILE_ELEMENTS", "KERNEL_TILE_ELEMENTS"):
        monkeypatch.setattr(quantized, constant, 128 * 47)
    monkeypatch.setattr(mesp_loss, "QUANTIZED_HEAD_VOCAB_CHUNK", 100)
    loss, grads = METHODS.get("mesp")(model).gradients(batch)
    reference_loss, reference = METHODS.get("bp")(dense).gradients(batch)
    config = model.config
    assert {rows for rows, _ in tiles} >= {config.hidden_size, config.intermediate_size, config.vocab_size}
    assert max(size for rows, size in tiles if rows != config.vocab_size) <= 128 * 47
    assert max(size for rows, size in tiles if rows == config.vocab_size) <= 100 * config.hidden_size
    assert abs(float(loss) - float(reference_loss)) <= 1e-5 * abs(float(reference_loss))
    num = sum(float((grads[k] - reference[k]).norm() ** 2) for k in reference) ** 0.5
    den = sum(float(reference[k].norm() ** 2) for k in reference) ** 0.5
    assert num <= 1e-5 * den, num / den
