"""Files made by llama.cpp's own quantizer (tests/fixtures/gguf, remade by tools/make_gguf_fixtures.py): a
tiny llama model in every block format edgetrain reads, with llama.cpp's logits on fixed tokens.

Every tensor dequantises as gguf-py does, bit for bit; the packed model's logits follow llama.cpp's
(correlation >= 0.999, the same top token at >= 95% of positions: llama.cpp rounds activations to 8 bits
for its k-quant products, so its logits are not bit-equal to a float32 product); packed and dense bases
give the same logits and every method's gradients; the resident bytes are the file's."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import edgetrain
from edgetrain.data.batch import Batch
from edgetrain.methods import METHODS
from edgetrain.models.gguf.dequant import dequantize
from edgetrain.models.gguf.loader import load_gguf
from edgetrain.models.gguf.reader import read_gguf
from edgetrain.models.quantized import PackedMatrix
from gguf_blocks_testkit import assert_follows_llama_cpp
from quantized_testkit import dense_twin
from testkit import random_lora_b

gguf = pytest.importorskip("gguf")

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "gguf"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
FILE_TYPES = sorted(MANIFEST["files"])
STORED = np.load(FIXTURES / "llama_cpp_logits.npz")
TOKENS = [int(t) for t in STORED["tokens"]]


def fixture(file_type: str) -> Path:
    return FIXTURES / MANIFEST["files"][file_type]["file"]


def _logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([TOKENS]))[0].double().numpy()


def test_the_fixtures_hold_every_block_format_edgetrain_reads():
    from edgetrain.models.gguf.blocks import BLOCK_FORMATS

    held = {t for info in MANIFEST["files"].values() for t in info["types"]}
    # Q4_0, Q4_1 and Q8_0 have their own gguf-py-made tests (test_gguf.py, test_quantized.py).
    assert held >= {f.name for f in BLOCK_FORMATS.values()} - {"Q4_0", "Q4_1", "Q8_0"}


@pytest.mark.parametrize("file_type", FILE_TYPES)
def test_every_tensor_dequantises_bit_for_bit_as_gguf_py(file_type):
    file = read_gguf(fixture(file_type))
    assert {info.name: info.type_name for info in file.tensors.values()} == MANIFEST["files"][file_type]["tensors"]
    for info in file.tensors.values():
        raw = file.tensor_bytes(info)
        ours = dequantize(raw, info.ggml_type, info.shape)
        theirs = gguf.quants.dequantize(np.asarray(raw), gguf.GGMLQuantizationType(info.ggml_type))
        np.testing.assert_array_equal(ours.view(np.uint32), theirs.astype(np.float32).reshape(info.shape).view(np.uint32),
                                      err_msg=info.name)


@pytest.mark.parametrize("file_type", FILE_TYPES)
def test_the_packed_model_follows_llama_cpps_logits_and_equals_the_dense_one(file_type):
    packed, dense = load_gguf(fixture(file_type), quantized=True), load_gguf(fixture(file_type))
    matrices = [m for m in packed.modules() if isinstance(m, PackedMatrix)]
    assert len(matrices) == 9  # 7 block projections, the embedding, the head: none dequantised
    ours = _logits(packed)
    assert_follows_llama_cpp(ours, STORED[file_type], file_type)
    np.testing.assert_allclose(ours, _logits(dense), rtol=0, atol=1e-5 * np.abs(ours).max())


@pytest.mark.parametrize("file_type", FILE_TYPES)
def test_a_packed_model_holds_about_the_files_bytes(file_type):
    """At most one byte a group above the file's bytes for the same tensors (the k-quants' 6-bit sub-block
    steps are a byte each here)."""
    file = read_gguf(fixture(file_type))
    model = load_gguf(fixture(file_type), quantized=True)
    file_bytes = sum(info.nbytes for info in file.tensors.values() if len(info.shape) == 2)
    held = sum(m.packed_bytes() for m in model.modules() if isinstance(m, PackedMatrix))
    groups = sum(m.rows * m.cols // m.group_size for m in model.modules() if isinstance(m, PackedMatrix))
    assert file_bytes * 0.99 <= held <= file_bytes + groups, (held, file_bytes)


@pytest.mark.parametrize("method", ["bp", "mebp", "mesp", "mezo"])
@pytest.mark.parametrize("file_type", ["Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "Q5_1", "IQ4_XS"])
def test_gradients_on_the_packed_base_equal_autograd_through_the_dequantised_one(method, file_type):
    model = load_gguf(fixture(file_type), quantized=True)
    torch.manual_seed(0)
    edgetrain.add_lora(model, rank=4)
    random_lora_b(model, seed=1, scale=0.02)
    dense = dense_twin(model)
    ids = torch.tensor([TOKENS[:25], TOKENS[8:33]])
    batch = Batch(ids[:, :-1].clone(), ids[:, 1:].clone(), 0)
    loss, grads = METHODS.get(method)(model).gradients(batch)
    reference_loss, reference = METHODS.get("bp" if method != "mezo" else "mezo")(dense).gradients(batch)
    assert abs(float(loss) - float(reference_loss)) <= 1e-5 * abs(float(reference_loss))
    num = sum(float((grads[k] - reference[k]).norm() ** 2) for k in reference) ** 0.5
    den = sum(float(reference[k].norm() ** 2) for k in reference) ** 0.5
    assert num <= 1e-5 * den, (method, file_type, num / den)


def test_k_quant_tiles_give_the_whole_products_gradient_and_rows(monkeypatch):
    import edgetrain.models.quantized as quantized

    model = load_gguf(fixture("Q3_K_M"), quantized=True).double()
    layers = [m for m in model.modules() if isinstance(m, quantized.QuantizedLinear)]
    assert {m.bits for m in layers} >= {3, 4, 5, 6}
    for layer in layers:
        x = torch.randn(3, layer.in_features, dtype=torch.float64, generator=torch.Generator().manual_seed(0),
                        requires_grad=True)
        whole = layer(x)
        (whole_grad,) = torch.autograd.grad(whole.square().sum(), x)
        with monkeypatch.context() as patch:
            for constant in ("TILE_ELEMENTS", "KERNEL_TILE_ELEMENTS"):  # 7 rows a tile, the last short
                patch.setattr(quantized, constant, layer.in_features * 7)
            tiled = layer(x)
            (tiled_grad,) = torch.autograd.grad(tiled.square().sum(), x)
        torch.testing.assert_close(tiled, whole, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(tiled_grad, whole_grad, rtol=1e-12, atol=1e-12)
        rows = torch.tensor([[5, 0], [layer.rows - 1, 5]])
        torch.testing.assert_close(layer.dequantize_gathered(rows), layer.dequantize()[rows], rtol=0, atol=0)


@pytest.mark.parametrize("file_type", ["Q2_K", "Q3_K_M", "Q5_1", "IQ4_XS"])
def test_a_non_finite_scale_in_any_block_format_is_refused_naming_the_tensor(file_type, tmp_path):
    """A NaN in one f16 field of one block (each type of the file in turn): every loader refuses the file
    with a GGUFError naming the tensor, packed or dequantised."""
    from edgetrain.models.gguf.reader import GGUFError
    from gguf_blocks_testkit import F16_FIELDS

    source = fixture(file_type)
    file = read_gguf(source)
    firsts = {}
    for info in file.tensors.values():
        if info.type_name in F16_FIELDS:
            firsts.setdefault(info.type_name, info)
    assert firsts
    for type_name, info in firsts.items():
        for field in F16_FIELDS[type_name]:
            damaged = tmp_path / f"{type_name}-{field}.gguf"
            raw = bytearray(source.read_bytes())
            raw[info.offset + field:info.offset + field + 2] = np.array([np.nan], dtype="<f2").tobytes()
            damaged.write_bytes(bytes(raw))
            for quantized in (True, False):
                with pytest.raises(GGUFError, match=rf"{info.name!r} holds NaN or infinite values"):
                    load_gguf(damaged, quantized=quantized)
