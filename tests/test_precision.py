"""Reductions run in edgetrain.training.precision.compute_dtype: fp32 for bf16 and fp32 models (as the reference
implementations), fp64 for fp64 models -- which used to normalise and take the loss in fp32, so that an
"fp64 reference" was off the exact value by fp32 rounding."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgetrain.models.llama import RMSNorm
from edgetrain.training.losses import classify_loss, lm_loss
from edgetrain.training.precision import compute_dtype


def test_compute_dtype_is_at_least_fp32_and_keeps_fp64():
    assert compute_dtype(torch.bfloat16) == compute_dtype(torch.float16) == torch.float32
    assert compute_dtype(torch.float32) == torch.float32
    assert compute_dtype(torch.float64) == compute_dtype(torch.bfloat16, torch.float64) == torch.float64


def _norm_inputs(dtype: torch.dtype) -> tuple[RMSNorm, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(96, generator=generator, dtype=torch.float64))
    return norm, (3 * torch.randn(4, 7, 96, generator=generator, dtype=torch.float64)).to(dtype)


def test_an_fp64_models_rmsnorm_is_the_fp64_formula():
    norm, x = _norm_inputs(torch.float64)
    with torch.no_grad():
        got = norm(x)
    expected = norm.weight.detach() * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    assert got.dtype == torch.float64
    assert float((got - expected).abs().max() / expected.abs().max()) <= 1e-12


def test_a_bf16_models_rmsnorm_still_normalises_in_fp32():
    norm, x = _norm_inputs(torch.bfloat16)
    with torch.no_grad():
        got = norm(x)
    x32 = x.float()
    expected = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)


@pytest.mark.parametrize("loss, targets", [(lm_loss, torch.tensor([[3, -100, 7, 1, 0]])),
                                           (classify_loss, torch.tensor([3, 7, 1, 0, 2]))])
def test_an_fp64_models_loss_is_taken_in_fp64(loss, targets):
    generator = torch.Generator().manual_seed(1)
    shape = (1, 5, 11) if targets.dim() == 2 else (5, 11)
    logits = 4 * torch.randn(shape, generator=generator, dtype=torch.float64)
    got = loss(logits, targets)
    expected = F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1), ignore_index=-100)
    assert got.dtype == torch.float64
    assert abs(float(got - expected)) <= 1e-14 * abs(float(expected))
    assert loss(logits.float(), targets).dtype == torch.float32
    assert loss(logits.to(torch.bfloat16), targets).dtype == torch.float32
