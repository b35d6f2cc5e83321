"""Every block format on MLX: those MLX can hold (32-value groups, affine: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q4_K, Q5_K) are kept quantised with mx.dequantize giving ggml's values exactly, on random blocks with
extreme scales; the rest (Q2_K, Q3_K, Q6_K with 16-value groups, IQ4_NL and IQ4_XS on a non-uniform grid)
are dequantised with one log line naming them. On llama.cpp's fixture files (tests/fixtures/gguf) the MLX
model's logits equal the torch loader's."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install edgetrain[mlx])")
torch = pytest.importorskip("torch")

from edgetrain.backends.mlx.gguf import load_gguf_mlx  # noqa: E402
from edgetrain.backends.mlx.quantize import QuantizedLinear  # noqa: E402
from edgetrain.models.gguf.blocks import BLOCK_FORMATS  # noqa: E402
from edgetrain.models.gguf.dequant import dequantize  # noqa: E402
from edgetrain.models.gguf.loader import load_gguf  # noqa: E402
from edgetrain.models.gguf.packed import PACKABLE_TYPES, pack_blocks  # noqa: E402
from gguf_blocks_testkit import random_blocks  # noqa: E402

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "gguf"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
TOKENS = [int(t) for t in np.load(FIXTURES / "llama_cpp_logits.npz")["tokens"]]
# fp32 logits of the same weights on MLX and torch: only the order of float32 sums differs (tests/mlx/
# test_mlx_gguf.py measured 1e-6 .. 2.6e-6 of the largest logit).
LOGITS_TOLERANCE = 1e-5


def test_mlx_keeps_exactly_the_32_value_affine_formats():
    assert {BLOCK_FORMATS[t].name for t in PACKABLE_TYPES} == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K"}


@pytest.mark.parametrize("type_id", sorted(PACKABLE_TYPES), ids=lambda t: BLOCK_FORMATS[t].name)
def test_kept_formats_dequantise_on_mlx_to_ggmls_values(type_id):
    fmt = BLOCK_FORMATS[type_id]
    rows, cols = 4, 512
    raw = random_blocks(fmt.name, rows * cols // fmt.block_values, seed=type_id).reshape(-1)
    packed = pack_blocks(raw, type_id, (rows, cols))
    assert packed.bits == fmt.bits and packed.group_size == 32
    got = np.array(mx.dequantize(mx.array(packed.weight), mx.array(packed.scales), mx.array(packed.biases),
                                 group_size=32, bits=packed.bits))
    # As values: MLX's c d - z d is +0.0 where ggml's (c - z) d with d < 0 is -0.0 (packed.py).
    np.testing.assert_array_equal(got, dequantize(raw, type_id, (rows, cols)))


@pytest.mark.parametrize("file_type", sorted(MANIFEST["files"]))
def test_each_fixture_loads_on_mlx_with_torchs_logits_and_names_what_it_dequantised(file_type, caplog):
    info = MANIFEST["files"][file_type]
    path = FIXTURES / info["file"]
    with caplog.at_level(logging.INFO, logger="edgetrain.backends.mlx.gguf"):
        model = load_gguf_mlx(path)
    kept = {name for name, module in model.named_modules() if isinstance(module, QuantizedLinear)}
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    expected = {f"blocks.0.{'self_attn' if ours[0] in 'qkvo' else 'mlp'}.{ours}" for ours, theirs in names.items()
                if info["tensors"][f"blk.0.{theirs}.weight"] in ("Q4_K", "Q5_K", "Q5_0", "Q5_1", "Q8_0")}
    assert kept == expected
    logged = " ".join(r.getMessage() for r in caplog.records)
    for tensor, type_name in info["tensors"].items():
        if type_name not in ("F32", "Q4_K", "Q5_K", "Q5_0", "Q5_1") or tensor in ("token_embd.weight", "output.weight"):
            if type_name != "F32":
                assert f"{tensor} ({type_name})" in logged
    ids = np.array([TOKENS])
    got = np.array(model(mx.array(ids.astype(np.int32))))
    with torch.no_grad():
        expected_logits = load_gguf(path, quantized=True)(torch.from_numpy(ids)).numpy()
    assert float(np.abs(got - expected_logits).max() / np.abs(expected_logits).max()) <= LOGITS_TOLERANCE


@pytest.mark.parametrize("file_type", ["Q4_K_M", "Q5_K_M", "Q5_0"])
def test_mesp_gives_bp_gradients_on_a_kept_k_quant_base(file_type):
    from edgetrain.backends.mlx.lora import add_lora
    from edgetrain.backends.mlx.methods import MLX_METHODS

    mx.random.seed(0)
    model = load_gguf_mlx(FIXTURES / MANIFEST["files"][file_type]["file"])
    add_lora(model, rank=4)
    for name, module in model.named_modules():  # a fresh B is zero, which makes every A gradient zero
        if hasattr(module, "lora_b"):
            module.lora_b = mx.random.normal(module.lora_b.shape) * 0.02
    assert any(isinstance(m, QuantizedLinear) and m.bits == int(file_type[1]) for _, m in model.named_modules())
    ids = mx.array(np.array([TOKENS[:25], TOKENS[8:33]], dtype=np.int32))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    reference_loss, reference = MLX_METHODS.get("bp")(model).gradients(inputs, targets)
    loss, grads = MLX_METHODS.get("mesp")(model).gradients(inputs, targets)
    assert set(grads) == set(reference) and len(grads) == 7 * 2
    assert abs(float(loss) - float(reference_loss)) <= 1e-5 * abs(float(reference_loss))
    assert max(float(mx.max(mx.abs(grads[k] - reference[k])) / mx.max(mx.abs(reference[k]))) for k in reference) <= 1e-5


@pytest.mark.parametrize("file_type", ["Q4_K_M", "Q5_1", "Q3_K_M"])
def test_a_non_finite_scale_in_a_kept_or_dequantised_format_is_refused_on_mlx(file_type, tmp_path):
    from edgetrain.models.gguf.reader import GGUFError, read_gguf

    source = FIXTURES / MANIFEST["files"][file_type]["file"]
    for info in read_gguf(source).tensors.values():
        if info.name.startswith("blk.") and info.type_name != "F32":
            break
    damaged = tmp_path / "damaged.gguf"
    raw = bytearray(source.read_bytes())
    at = info.offset + {"Q2_K": 80, "Q3_K": 108, "Q6_K": 208}.get(info.type_name, 0)  # the block's d
    raw[at:at + 2] = np.array([np.inf], dtype="<f2").tobytes()
    damaged.write_bytes(bytes(raw))
    with pytest.raises(GGUFError, match=rf"{info.name!r} holds NaN or infinite values"):
        load_gguf_mlx(damaged)
