"""Build a model's modules on the meta device without running their weight initialisers.

A loader builds the model on the meta device and assigns every weight from the file. Under `torch.device
("meta")` alone, each module's reset_parameters still calls torch.nn.init on meta tensors; those calls run
torch's Python reference kernels, whose first use imports torch._dynamo: about 70 MiB resident, for random
values that never exist. `meta_without_init()` answers the initialisers itself (they return their tensor
unchanged). It is a torch function mode, so it acts on this thread only: a model initialised meanwhile on
another thread gets its random weights as usual.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class _SkipInitialisers(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else (kwargs or {}).get("tensor")
        return func(*args, **(kwargs or {}))


@contextmanager
def meta_without_init() -> Iterator[None]:
    """Tensors made inside are on the meta device, and torch.nn.init's functions leave them as they are."""
    with torch.device("meta"), _SkipInitialisers():
        yield
