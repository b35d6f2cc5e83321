"""GGUF on MLX: Q4_0 / Q4_1 / Q8_0 block projections stay quantised (the file's integers and scales in
MLX's layout, never requantised), so their dequantised values equal the torch loader's exactly and the
logits match torch's on the same file; the same files are refused with the same words; LoRA trains on
top of the quantised base. Small llama / qwen2 files are written with the `gguf` package
(tests/gguf_testkit.py's writer)."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install edgetrain[mlx])")
gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")  # test_gguf builds its source models with transformers

import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

import edgetrain  # noqa: E402
from edgetrain.backends.mlx.gguf import load_gguf_mlx  # noqa: E402
from edgetrain.models.gguf.packed import pack_blocks  # noqa: E402
from edgetrain.training.learner import Learner  # noqa: E402
from edgetrain.backends.mlx.lora import add_lora  # noqa: E402
from edgetrain.backends.mlx.methods import MLX_METHODS  # noqa: E402
from edgetrain.backends.mlx.model import MLXDecoder  # noqa: E402
from edgetrain.backends.mlx.quantize import BLOCK_LINEARS, QuantizedLinear  # noqa: E402
from edgetrain.data.batch import Batch  # noqa: E402
from edgetrain.models.gguf import GGUFError, GGUFTokenizer, dequantize, load_gguf  # noqa: E402
from edgetrain.models.gguf import loader as gguf_loader  # noqa: E402

from gguf_testkit import VOCAB, gguf_name, hf_model, write_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType
PACKED = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q8_0: 8}
# MLX's logits against the torch loader's on the same file, fp32, max |difference| / max |torch logit|:
# measured 1.0e-6 .. 2.6e-6 on these files (the weights are equal; only the order of the float32 sums
# differs), so 1e-5 leaves room for other BLAS builds.
LOGITS_TOLERANCE = 1e-5


def _tokens(seq_len: int = 24) -> np.ndarray:
    return np.random.default_rng(5).integers(0, len(VOCAB[0]), (2, seq_len))


def _relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(got - expected).max() / np.abs(expected).max())


def _logits_both(path: Path, **mlx_options) -> tuple[np.ndarray, np.ndarray]:
    tokens = _tokens()
    with torch.no_grad():
        expected = load_gguf(path)(torch.from_numpy(tokens)).numpy()
    got = np.array(load_gguf_mlx(path, **mlx_options)(mx.array(tokens.astype(np.int32))))
    return got, expected


def _replace(writer, name: str, values: np.ndarray, qtype) -> None:
    writer.tensors[0].pop(name)
    if qtype in (Q.F32, Q.F16):
        writer.add_tensor(name, values.astype(np.float32 if qtype == Q.F32 else np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)


def _mixed(path: Path, hf_model) -> Path:
    """As llama.cpp's Q4_1 files are: Q4_1 projections, a Q8_0 embedding, here also an F16 LM head and
    one F16 projection."""
    state = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}

    def tweak(writer):
        _replace(writer, "token_embd.weight", state["model.embed_tokens.weight"], Q.Q8_0)
        _replace(writer, "output.weight", state["lm_head.weight"], Q.F16)
        _replace(writer, "blk.1.attn_v.weight", state["model.layers.1.self_attn.v_proj.weight"], Q.F16)

    return write_gguf(path, hf_model, Q.Q4_1, tweak=tweak)


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory):
    return _mixed(tmp_path_factory.mktemp("gguf-mlx") / "mixed.gguf", hf_model())


def _linears(model) -> dict[str, object]:
    found = {}
    for index, block in enumerate(model.blocks):
        for path in BLOCK_LINEARS:
            module = block
            for part in path.split("."):
                module = getattr(module, part)
            found[f"blocks.{index}.{path}"] = module
    return found


# ---------------------------------------------------------------------------------------------------
# The block formats in MLX's layout


@pytest.mark.parametrize("qtype", list(PACKED), ids=lambda q: q.name)
def test_packed_blocks_dequantise_to_ggml_values(qtype):
    """mx.dequantize of the repacked blocks equals ggml's values; this fixes MLX's packing order (element j
    of a uint32 word in bits [bits j, bits (j + 1))) and the scale/bias mapping of each format."""
    rng = np.random.default_rng(int(qtype))
    values = rng.standard_normal((6, 96)).astype(np.float32)
    values[0] = 0.0  # an all-zero block (scale 0)
    values[1] *= 1e4  # large scales
    values[2, :32] = np.linspace(-1, 1, 32)  # every quantisation level in one block
    raw = np.ascontiguousarray(gguf.quants.quantize(values, qtype)).view(np.uint8).reshape(-1)
    packed = pack_blocks(raw, int(qtype), values.shape)
    assert packed.bits == PACKED[qtype] and packed.group_size == 32 and packed.weight.dtype == np.uint32
    got = np.array(mx.dequantize(mx.array(packed.weight), mx.array(packed.scales), mx.array(packed.biases),
                                 group_size=32, bits=packed.bits))
    # Equal as values (assert_array_equal counts -0.0 == +0.0: MLX's d * 0 - 8 d is +0.0 where ggml has -0.0).
    np.testing.assert_array_equal(got, dequantize(raw, int(qtype), values.shape))


@pytest.mark.parametrize("qtype", list(PACKED), ids=lambda q: q.name)
def test_packing_equals_mlx_own_gguf_import(tmp_path, qtype):
    """mx.load reads Q4_0 / Q4_1 / Q8_0 GGUF tensors into the same layout (with f16 scales): the same words
    and the same scales and biases, an independent check of the mapping. (mx.load does not check the file,
    nor undo llama's Q/K row order, so it is compared on the other projections only.)"""
    path = write_gguf(tmp_path / f"{qtype.name}.gguf", hf_model(), qtype)
    theirs = mx.load(str(path))
    ours = load_gguf_mlx(path)
    for name, layer in _linears(ours).items():
        if ".self_attn.q_proj" in name or ".self_attn.k_proj" in name:
            continue
        stem = gguf_name(f"model.layers.{name.removeprefix('blocks.')}.weight").removesuffix(".weight")
        assert np.array_equal(np.array(layer.weight), np.array(theirs[f"{stem}.weight"])), name
        assert np.array_equal(np.array(layer.scales), np.array(theirs[f"{stem}.scales"].astype(mx.float32))), name
        assert np.array_equal(np.array(layer.biases), np.array(theirs[f"{stem}.biases"].astype(mx.float32))), name


# ---------------------------------------------------------------------------------------------------
# Loading: the weights are the torch loader's, the logits match


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.F32], ids=lambda q: q.name)
def test_weights_equal_the_torch_loaders_dequantised_ones(tmp_path, qtype):
    path = write_gguf(tmp_path / f"{qtype.name}.gguf", hf_model(), qtype)
    ours, reference = load_gguf_mlx(path), load_gguf(path)
    assert isinstance(ours, MLXDecoder)
    for name, layer in _linears(ours).items():
        expected = reference.get_parameter(f"{name}.weight").detach().numpy()
        if qtype in PACKED:
            assert isinstance(layer, QuantizedLinear) and (layer.bits, layer.group_size) == (PACKED[qtype], 32)
            assert layer.weight.dtype == mx.uint32 and layer.scales.dtype == mx.float32
            np.testing.assert_array_equal(np.array(layer.dense_weight()), expected, err_msg=name)  # Q/K unpermuted too
        else:
            assert isinstance(layer, nn.Linear) and not isinstance(layer, QuantizedLinear)
            np.testing.assert_array_equal(np.array(layer.weight), expected, err_msg=name)
    # The embedding and LM head are dense: dequantised, they equal torch's too.
    np.testing.assert_array_equal(np.array(ours.embed.embed_tokens.weight),
                                  reference.embed.embed_tokens.weight.detach().numpy())
    np.testing.assert_array_equal(np.array(ours.head.lm_head.weight), reference.head.lm_head.weight.detach().numpy())


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.F32], ids=lambda q: q.name)
def test_logits_match_torch_on_the_same_file(tmp_path, qtype):
    got, expected = _logits_both(write_gguf(tmp_path / f"{qtype.name}.gguf", hf_model(), qtype))
    assert _relative_error(got, expected) <= LOGITS_TOLERANCE


def test_a_mixed_file_keeps_each_tensor_as_stored_and_says_what_it_dequantised(mixed_file, caplog):
    with caplog.at_level(logging.INFO, logger="edgetrain"):
        model = load_gguf_mlx(mixed_file)
    layers = _linears(model)
    assert isinstance(layers["blocks.0.self_attn.v_proj"], QuantizedLinear)
    assert not isinstance(layers["blocks.1.self_attn.v_proj"], QuantizedLinear)  # stored F16
    assert sum(isinstance(layer, QuantizedLinear) for layer in layers.values()) == len(layers) - 1
    records = [r for r in caplog.records if r.name == "edgetrain.backends.mlx.gguf"]
    assert len(records) == 1 and "token_embd.weight (Q8_0)" in records[0].getMessage()
    assert "output.weight" not in records[0].getMessage()  # F16 is not dequantised: it is dense anyway
    got, expected = _logits_both(mixed_file)
    assert _relative_error(got, expected) <= LOGITS_TOLERANCE


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tied_embeddings_and_qwen2_biases_on_quantised_projections(tmp_path, arch):
    path = write_gguf(tmp_path / f"{arch}.gguf", hf_model(arch, tie=True, seed=1), Q.Q4_0)
    model = load_gguf_mlx(path)
    assert model.config.tie_word_embeddings and "lm_head" not in model.head
    q_proj = model.blocks[0].self_attn.q_proj
    assert isinstance(q_proj, QuantizedLinear) and ("bias" in q_proj) == (arch == "qwen2")
    got, expected = _logits_both(path)
    assert _relative_error(got, expected) <= LOGITS_TOLERANCE


def test_qk_unpermute_is_the_torch_loaders_and_is_needed(mixed_file, monkeypatch):
    got, expected = _logits_both(mixed_file)
    assert _relative_error(got, expected) <= LOGITS_TOLERANCE
    monkeypatch.setattr(gguf_loader, "unpermute_rope_rows", lambda tensor, heads: tensor)
    wrong = np.array(load_gguf_mlx(mixed_file)(mx.array(_tokens().astype(np.int32))))
    assert _relative_error(wrong, expected) > 1e-2


def test_dtype_holds_scales_and_dense_weights(mixed_file):
    half = load_gguf_mlx(mixed_file, dtype="float16")
    full = load_gguf_mlx(mixed_file)
    layer, reference = half.blocks[0].mlp.up_proj, full.blocks[0].mlp.up_proj
    assert layer.scales.dtype == mx.float16 and half.embed.embed_tokens.weight.dtype == mx.float16
    # ggml's scales and Q4_1 minimums are f16 numbers: float16 holds them exactly.
    np.testing.assert_array_equal(np.array(layer.scales.astype(mx.float32)), np.array(reference.scales))
    np.testing.assert_array_equal(np.array(layer.biases.astype(mx.float32)), np.array(reference.biases))
    got = np.array(half(mx.array(_tokens().astype(np.int32))).astype(mx.float32))
    assert _relative_error(got, np.array(full(mx.array(_tokens().astype(np.int32))))) <= 2e-2


def test_load_model_routes_gguf_to_mlx_with_its_tokenizer(mixed_file):
    model = edgetrain.load_model(mixed_file, backend="mlx")
    assert isinstance(model, MLXDecoder) and isinstance(model.blocks[0].mlp.up_proj, QuantizedLinear)
    assert isinstance(model.tokenizer, GGUFTokenizer)
    text = "The quick brown fox jumps over the lazy dog."
    assert model.tokenizer.encode(text) == edgetrain.load_model(mixed_file).tokenizer.encode(text)


# ---------------------------------------------------------------------------------------------------
# The same files are refused with the same words


def test_a_type_it_cannot_read_is_named(tmp_path):
    def q8_1(writer):  # llama.cpp's activation type: never a weight edgetrain reads
        name = "blk.0.ffn_up.weight"
        rows, cols = tuple(writer.tensors[0].pop(name).shape)
        writer.add_tensor(name, np.zeros((rows, cols // 32 * 40), np.uint8), raw_dtype=Q.Q8_1)

    path = write_gguf(tmp_path / "q8_1.gguf", hf_model(), Q.Q4_1, tweak=q8_1)
    for backend in ("torch", "mlx"):
        with pytest.raises(GGUFError, match=r"'blk\.0\.ffn_up\.weight' is stored as Q8_1.*supported: F32, F16, BF16, "
                                            r"Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS"):
            edgetrain.load_model(path, backend=backend)


@pytest.mark.parametrize("qtype", list(PACKED), ids=lambda q: q.name)
def test_a_non_finite_scale_in_a_kept_quantised_tensor_is_refused(tmp_path, qtype):
    def nan_scale(writer):
        raw = writer.tensors[0]["blk.1.ffn_down.weight"].tensor.view(np.uint8)
        at = 2 if qtype == Q.Q4_1 else 0  # Q4_1's minimum m, the others' scale d, of the first block
        raw[0, at:at + 2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)

    path = write_gguf(tmp_path / "nan.gguf", hf_model(), qtype, tweak=nan_scale)
    for backend in ("torch", "mlx"):
        with pytest.raises(GGUFError, match=r"'blk\.1\.ffn_down\.weight' holds NaN or infinite values"):
            edgetrain.load_model(path, backend=backend)


def test_inconsistent_metadata_is_refused_as_on_torch(tmp_path):
    def edit(writer):
        writer.kv_data[0]["llama.feed_forward_length"].value = 96

    path = write_gguf(tmp_path / "inconsistent.gguf", hf_model(), Q.Q4_1, tweak=edit)
    with pytest.raises(GGUFError, match=r"'blk\.0\.ffn_gate\.weight' has shape \(128, 64\)"):
        edgetrain.load_model(path, backend="mlx")


# ---------------------------------------------------------------------------------------------------
# Training on the quantised base


def _with_lora(path: Path) -> MLXDecoder:
    model = edgetrain.load_model(path, backend="mlx")
    add_lora(model, rank=4)
    keys = iter(mx.random.split(mx.random.key(1), 64))
    for layer in (m for _, m in model.named_modules() if hasattr(m, "lora_b")):
        layer.lora_b = mx.random.normal(layer.lora_b.shape, key=next(keys)) * 0.02
    return model


def _text_batch(seq: int = 32) -> Batch:
    ids = torch.from_numpy(np.random.default_rng(3).integers(0, len(VOCAB[0]), (2, seq + 1)))
    return Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), 0)


def test_mesp_gives_bp_gradients_on_a_quantised_gguf_base(mixed_file):
    model = _with_lora(mixed_file)
    batch = _text_batch()
    inputs, targets = (mx.array(t.numpy().astype(np.int32)) for t in (batch.inputs, batch.targets))
    reference_loss, reference = MLX_METHODS.get("bp")(model).gradients(inputs, targets)
    loss, grads = MLX_METHODS.get("mesp")(model).gradients(inputs, targets)
    assert set(grads) == set(reference) and len(grads) == 2 * 7 * 2
    assert abs(float(loss) - float(reference_loss)) <= 1e-5 * abs(float(reference_loss))
    assert max(float(mx.max(mx.abs(grads[k] - reference[k])) / mx.max(mx.abs(reference[k]))) for k in reference) <= 1e-5


def test_a_mesp_step_changes_only_the_lora_weights(mixed_file):
    model = _with_lora(mixed_file)
    before = {name: np.array(value) for name, value in tree_flatten(model.parameters())}
    stats = Learner(model, backend="mlx", method="mesp", optimizer="adamw", lr=1e-2).step(_text_batch())
    assert np.isfinite(stats.loss)
    after = {name: np.array(value) for name, value in tree_flatten(model.parameters())}
    assert set(after) == set(before)
    lora = {name for name in before if ".lora_" in name}
    assert len(lora) == 2 * 7 * 2 and any(name.endswith(".scales") for name in before)
    changed = {name for name in before if not np.array_equal(before[name], after[name])}
    assert changed == lora
