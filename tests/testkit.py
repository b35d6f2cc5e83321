"""Helpers that test modules import by name (`from testkit import ...`). They live here rather than in
conftest.py because several conftest.py files share that module name, and which one `import conftest`
finds depends on which directories a run collects."""
from __future__ import annotations

import torch

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


def move_norms_off_one(model, std: float = 0.3) -> None:
    """Add N(0, std) to every norm weight (transformers starts them at one, Gemma's w at zero), so that a norm
    read or differentiated wrongly shows in the logits and gradients. Draws from torch's global generator."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn(param.shape) * std)


def random_lora_b(model, seed: int, scale: float) -> None:
    """A fresh LoRA B is zero, which makes every A gradient zero: useless for parity. Fill each B from its
    own seeded generator instead."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.copy_(torch.randn(param.shape, generator=generator) * scale)


def process_memory_state() -> dict:
    """What else in this process could move an RSS reading (for failure messages of memory tests): live
    threads, mappings, the main heap's size and how much of it plugged_free_heap would occupy."""
    import os
    import threading

    from edgetrain.probes.glibc import main_heap_range, plugged_free_heap

    state: dict = {"python_threads": sorted(t.name for t in threading.enumerate())}
    try:
        state["os_threads"] = len(os.listdir("/proc/self/task"))
        with open("/proc/self/maps") as maps:
            state["mappings"] = sum(1 for _ in maps)
    except OSError:
        pass
    heap = main_heap_range()
    if heap is not None:
        state["heap_mib"] = round((heap[1] - heap[0]) / 2**20, 1)
        with plugged_free_heap() as plugged:
            state["pluggable_mib"] = round(plugged / 2**20, 1)
    return state


def load_tool(name: str):
    """A script of tools/ as a module (tools/ is not a package): tools/NAME.py."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look a module up by name
    spec.loader.exec_module(module)
    return module
