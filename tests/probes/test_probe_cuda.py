"""CUDA probe: the unavailable path everywhere; the allocator figures where a GPU exists."""
from __future__ import annotations

import pytest
import torch

from edgetrain.probes import CudaProbe, ProbeUnavailableError, TensorAccountant, measure

has_cuda = torch.cuda.is_available()


@pytest.mark.skipif(has_cuda, reason="checks the no-CUDA path")
def test_unavailable_without_cuda_says_why():
    probe = CudaProbe()
    ok, reason = probe.available()
    assert not ok and "CUDA" in reason
    for read in (probe.reset_peak, probe.peak_bytes, probe.current_bytes):
        with pytest.raises(ProbeUnavailableError, match="CUDA"):
            read()
    with pytest.raises(ProbeUnavailableError):
        measure(probe, lambda: None)


def test_rejects_unknown_counts():
    with pytest.raises(ValueError, match="allocated"):
        CudaProbe(counts="free")


@pytest.mark.skipif(not has_cuda, reason="needs a CUDA GPU")
def test_rejects_a_device_that_is_not_cuda():
    ok, reason = CudaProbe("cpu").available()
    assert not ok and "not a CUDA device" in reason
    ok, reason = CudaProbe(torch.cuda.device_count()).available()
    assert not ok and "does not exist" in reason


@pytest.mark.skipif(not has_cuda, reason="needs a CUDA GPU")
def test_peak_of_a_known_allocation_and_agreement_with_the_accountant():
    probe = CudaProbe(0)
    assert probe.available() == (True, "")

    def region() -> None:
        a = torch.empty(1 << 20, device="cuda")        # 4 MiB
        b = torch.empty(3 << 20, device="cuda")        # 12 MiB
        del a
        c = torch.empty(1000, device="cuda")           # 4000 B -> one 4096-B block
        del b, c

    # Exact in a fresh process; a cached block too small to split may add under 1 MiB.
    assert 16 << 20 <= measure(probe, region) < 17 << 20
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 8)).cuda()
    x = torch.randn(512, 256, device="cuda")

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    step()  # warm up cuBLAS (its workspace is allocated by the caching allocator once)
    allocator_peak = measure(probe, step)
    tensor_peak = measure(TensorAccountant(model, device="cuda"), step)
    # Every counted storage is an allocator block at least its 512-rounded size, so the allocator
    # never reads less; it reads more by unsplit block tails (< 1 MiB each) and kernel workspaces.
    assert 0 < tensor_peak <= allocator_peak <= tensor_peak + max(tensor_peak // 10, 2 << 20)
