"""A real llama.cpp file on MLX: SmolLM2-135M-Instruct in Q4_1 (with a Q8_0 embedding; the file
tests/models/test_gguf_smollm.py fetches). Its 210 Q4_1 projections stay 4-bit on MLX; the logits match
the torch loader's dequantised model and greedy decoding with the cache writes torch's answer.

Slow (a 93 MB download once, cached in $EDGETRAIN_CACHE): run with `-m slow`.
"""
from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install edgetrain[mlx])")
torch = pytest.importorskip("torch")

import edgetrain  # noqa: E402
from edgetrain.backends.mlx.quantize import BLOCK_LINEARS, QuantizedLinear  # noqa: E402
from edgetrain.models.generate import generate_ids  # noqa: E402

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"




@pytest.mark.slow
def test_smollm2_q4_1_on_mlx_matches_torch(smollm2_file):
    ours = edgetrain.load_model(smollm2_file, backend="mlx")
    reference = edgetrain.load_model(smollm2_file)
    packed = [getattr(getattr(block, path.split(".")[0]), path.split(".")[1]) for block in ours.blocks
              for path in BLOCK_LINEARS]
    assert len(packed) == 30 * 7 and all(isinstance(layer, QuantizedLinear) and layer.bits == 4 for layer in packed)
    ids = reference.tokenizer.encode(PROMPT)
    assert ours.tokenizer.encode(PROMPT) == ids
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).numpy()
    got = np.array(ours(mx.array([ids], dtype=mx.int32)))
    # fp32, max |difference| / max |torch logit|: measured 3.0e-6 (equal weights, other summation order)
    assert float(np.abs(got - expected).max() / np.abs(expected).max()) <= 1e-5
    eos = reference.tokenizer.eos_token_id
    answer = generate_ids(ours, ids, 12, stop_ids=[eos])
    assert answer == generate_ids(reference, ids, 12, stop_ids=[eos])
    assert ours.tokenizer.decode(answer) == "The capital of France is Paris.<|im_end|>"
