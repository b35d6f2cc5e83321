"""edgetrain.load_model finds each backend's loader through the backend registry."""
from __future__ import annotations

import pytest
import torch

import edgetrain
from edgetrain.registry import EdgetrainError


def test_torch_is_torch_on_the_cpu():
    torch.manual_seed(0)
    plain = edgetrain.load_model("tiny")
    torch.manual_seed(0)
    cpu = edgetrain.load_model("tiny", backend="torch-cpu", dtype="bfloat16")
    assert next(plain.parameters()).device.type == next(cpu.parameters()).device.type == "cpu"
    assert next(cpu.parameters()).dtype == torch.bfloat16
    assert all(torch.equal(a.to(torch.bfloat16), b) for a, b in zip(plain.parameters(), cpu.parameters()))


def test_an_unknown_backend_lists_the_known_ones():
    with pytest.raises(EdgetrainError, match="unknown backend 'tpu'; known: mlx, torch, torch-cpu, torch-cuda"):
        edgetrain.load_model("tiny", backend="tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_backend_that_cannot_run_here_says_why_before_loading():
    with pytest.raises(EdgetrainError, match="backend 'torch-cuda' is not available here"):
        edgetrain.load_model("tiny", backend="torch-cuda")
