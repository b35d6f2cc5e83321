"""The personaliser's tests run torch on one thread: on a busy 2-core machine OpenMP's spinning makes tiny
kernels very slow, and the latency tests measure steps."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
