"""The packed base on MLX speaks the same vocabulary as on torch: load_model keeps a GGUF's Q4_0 / Q4_1 /
Q8_0 block projections packed by default, LoadOptions(dequantize=True) (--dequantize) holds them dense, and
eval on either gives the same perplexity; MLX's held-out loss runs its head a chunk of positions at a time."""
from __future__ import annotations

import json

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install edgetrain[mlx])")
pytest.importorskip("gguf")

import edgetrain  # noqa: E402
from edgetrain.backends.mlx.quantize import packed_matrix_count  # noqa: E402
from edgetrain.cli import main  # noqa: E402
from edgetrain.backends.load_options import LoadOptions  # noqa: E402

from gguf_testkit import Q, hf_model, write_gguf  # noqa: E402

TEXT = "the device learns where it runs, and keeps what it learned. " * 30


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mlx-packed")
    (directory / "held_out.txt").write_text(TEXT)
    return write_gguf(directory / "model.gguf", hf_model("llama"), Q.Q4_0)


def test_the_default_is_packed_and_dequantize_is_dense(gguf):
    packed = edgetrain.load_model(gguf, backend="mlx")
    dense = edgetrain.load_model(gguf, backend="mlx", options=LoadOptions(dequantize=True))
    assert packed_matrix_count(packed) == 7 * len(packed.blocks) and packed_matrix_count(dense) == 0
    tokens = mx.array(np.random.default_rng(0).integers(0, packed.config.vocab_size, (1, 12)), dtype=mx.int32)
    np.testing.assert_allclose(np.array(packed(tokens)), np.array(dense(tokens)), rtol=1e-5, atol=1e-5)
    # quantize_bits on the packed default: the Q4_0 blocks stay as stored (not requantised to 8 bits)
    kept = edgetrain.load_model(gguf, backend="mlx", quantize_bits=8)
    assert {m.bits for _, m in kept.named_modules() if hasattr(m, "bits")} == {4}


def _eval(capsys, gguf, *flags) -> dict:
    assert main(["eval", "--backend", "mlx", "--model", str(gguf), "--data", str(gguf.parent / "held_out.txt"),
                 "--seq", "32", "--batch", "2", "--max-batches", "2", "--quiet", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_eval_on_the_packed_base_equals_the_dense_base(gguf, capsys):
    packed, dense = _eval(capsys, gguf), _eval(capsys, gguf, "--dequantize")
    assert packed["tokens"] == dense["tokens"] > 0
    assert packed["loss"] == pytest.approx(dense["loss"], rel=1e-4)


def test_the_chunked_held_out_loss_equals_the_whole_logits_loss(gguf):
    from edgetrain.backends.mlx.token_loss import token_losses
    from edgetrain.data.batch import Batch

    torch = pytest.importorskip("torch")
    model = edgetrain.load_model(gguf, backend="mlx")
    inputs = torch.randint(0, model.config.vocab_size, (2, 40))
    targets = torch.randint(0, model.config.vocab_size, (2, 40))
    targets[0, 5:25] = -100
    logits = np.array(model(mx.array(inputs.numpy(), dtype=mx.int32)).astype(mx.float32), dtype=np.float64)
    flat, wanted = logits.reshape(-1, logits.shape[-1]), targets.numpy().reshape(-1)
    keep = wanted != -100
    top = flat.max(-1, keepdims=True)
    whole = (np.log(np.exp(flat - top).sum(-1)) + top[:, 0] - flat[np.arange(flat.shape[0]), np.maximum(wanted, 0)])
    from edgetrain.models import token_loss

    for chunk, block_positions in ((3, 512), (64, 512), (64, 40)):  # 40 positions: the blocks see a row a pass
        token_loss.EVAL_BLOCK_POSITIONS, saved = block_positions, token_loss.EVAL_BLOCK_POSITIONS
        try:
            losses = token_losses(model, mx.array(inputs.numpy(), dtype=mx.int32), mx.array(targets.numpy()), chunk)
        finally:
            token_loss.EVAL_BLOCK_POSITIONS = saved
        assert losses.size == keep.sum() == 60
        np.testing.assert_allclose(losses, whole[keep], rtol=1e-4, atol=1e-5)
    # The learner's evaluation (the personaliser's gate) reads the same chunked losses.
    from edgetrain.backends.mlx.lora import add_lora

    add_lora(model, rank=4)
    learner = edgetrain.Learner(model, method="mesp", backend="mlx")
    metrics = learner.evaluate([Batch(inputs, targets)])
    assert metrics["loss"] == pytest.approx(whole[keep].mean(), rel=1e-5)
