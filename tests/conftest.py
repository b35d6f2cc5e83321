"""Shared fixtures: real English text batches (Python's own pydoc topics) and small models."""
from __future__ import annotations

import logging
import os

import pytest
import torch

import edgetrain
from testkit import random_lora_b, text_token_batches


def _share_the_cores_between_workers() -> None:
    """Under pytest-xdist (tools/test runs `-n 2`), the workers share the machine's cores: each gets its
    share of intra-op threads, and so do the processes its tests start (OMP_NUM_THREADS). Two workers each
    running torch's default of one thread per core would wait on each other's threads, many times slower
    than either alone."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return
    threads = max(1, (os.cpu_count() or 1) // int(workers))
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


_share_the_cores_between_workers()


@pytest.fixture(autouse=True)
def edgetrain_logger_as_found():
    """The CLI configures the "edgetrain" logger (a stderr handler, a level) in-process; put it back after
    each test so that no test sees another's configuration."""
    logger = logging.getLogger("edgetrain")
    handlers, level = list(logger.handlers), logger.level
    yield logger
    logger.handlers[:] = handlers
    logger.setLevel(level)


@pytest.fixture
def text_batches():
    return text_token_batches


@pytest.fixture
def tiny_lora():
    def build(rank: int = 4, seed: int = 0, random_b: bool = True, quantize_bits: int | None = None, **lora):
        torch.manual_seed(seed)
        model = edgetrain.load_model("tiny", quantize_bits=quantize_bits)
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


@pytest.fixture(scope="session")
def smollm2_file():
    """SmolLM2-135M-Instruct's Q4_1 GGUF (fetched once into $EDGETRAIN_CACHE by edgetrain.models.downloads);
    the test is skipped, saying why, when it cannot be fetched."""
    from edgetrain.models.downloads import ModelDownloadError, fetch

    try:
        return fetch("smollm2-135m")
    except ModelDownloadError as exc:
        pytest.skip(f"SmolLM2-135M GGUF not available (offline?): {exc}")


@pytest.fixture
def loaded(monkeypatch):
    """Every model edgetrain.load_model returns during the test, in order (what the CLI and the
    personaliser really loaded: packed or dense)."""
    import edgetrain

    models = []
    real = edgetrain.models.load_model

    def spy(*args, **kwargs):
        models.append(real(*args, **kwargs))
        return models[-1]

    monkeypatch.setattr(edgetrain, "load_model", spy)
    return models
