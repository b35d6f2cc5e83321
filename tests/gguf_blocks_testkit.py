"""Random ggml blocks for the block-format tests (numpy, torch and MLX layouts)."""
from __future__ import annotations

import numpy as np

from edgetrain.models.gguf.blocks import BLOCK_FORMATS

# Byte offsets of each format's f16 fields within a block (ggml-common.h).
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82],
              "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_NL": [0], "IQ4_XS": [0]}
EXTREME_F16 = np.array([65504.0, -65504.0, 2.0 ** -24, -(2.0 ** -24), 0.0, -0.0, 1.0, -3.140625, 6.1e-5, 1e-3],
                       dtype=np.float16)


def random_blocks(type_name: str, blocks: int, seed: int = 0) -> np.ndarray:
    """uint8 [blocks, block_bytes]: random bytes, with every f16 field finite and extreme values among them."""
    fmt = next(f for f in BLOCK_FORMATS.values() if f.name == type_name)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(blocks, fmt.block_bytes), dtype=np.uint8)
    for offset in F16_FIELDS[type_name]:
        ordinary = rng.standard_normal(blocks).astype(np.float16) * np.float16(0.05)
        chosen = np.where(rng.random(blocks) < 0.3, EXTREME_F16[rng.integers(0, len(EXTREME_F16), blocks)], ordinary)
        raw[:, offset:offset + 2] = chosen.astype("<f2").view(np.uint8).reshape(blocks, 2)
    return raw


def assert_follows_llama_cpp(ours: np.ndarray, theirs: np.ndarray, what: str) -> None:
    """llama.cpp rounds activations to 8 bits for its block products, so its logits follow a float32
    product's closely without equalling them: correlation >= 0.999, the same top token at >= 95% of positions."""
    correlation = float(np.corrcoef(ours.ravel(), theirs.ravel())[0, 1])
    agreement = float((ours.argmax(-1) == theirs.argmax(-1)).mean())
    assert correlation >= 0.999 and agreement >= 0.95, (what, correlation, agreement)
