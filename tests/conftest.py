"""Shared fixtures: real English text batches (Python's own pydoc topics) and small models."""
from __future__ import annotations

import pytest
import torch

import edgetrain
from edgetrain.data.batch import Batch


def text_token_batches(count: int, seq_len: int = 32, batch_size: int = 2, offset: int = 0) -> list[Batch]:
    from pydoc_data.topics import topics

    data = "".join(topics[key] for key in sorted(topics)).encode("utf-8")
    ids = torch.tensor(list(data), dtype=torch.long)
    span = seq_len + 1
    batches = []
    for index in range(count):
        start = offset + index * batch_size * span
        chunk = ids[start:start + batch_size * span].view(batch_size, span)
        batches.append(Batch(chunk[:, :-1].clone(), chunk[:, 1:].clone(), index))
    return batches


@pytest.fixture
def text_batches():
    return text_token_batches


def random_lora_b(model, seed: int, scale: float) -> None:
    """A fresh LoRA B is zero, which makes every A gradient zero: useless for parity. Fill each B from its
    own seeded generator instead."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.copy_(torch.randn(param.shape, generator=generator) * scale)


@pytest.fixture
def tiny_lora():
    def build(rank: int = 4, seed: int = 0, random_b: bool = True, **lora):
        torch.manual_seed(seed)
        model = edgetrain.load_model("tiny")
        edgetrain.add_lora(model, rank=rank, **lora)
        if random_b:
            random_lora_b(model, seed + 1, 0.02)
        return model
    return build


@pytest.fixture
def one_thread():
    """One torch intra-op thread for the test (modules opt in with
    `pytestmark = pytest.mark.usefixtures("one_thread")`): bit-for-bit comparisons need a fixed
    reduction order, pipeline and torchrun workers run one thread each and the reference must match
    them, and on a busy 2-core machine OpenMP's spinning makes multi-threaded tiny kernels very slow."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
