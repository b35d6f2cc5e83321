"""Backend adapters: where tensors live and how to wait for the device (edgetrain.probes picks the
probe that reads its memory).

Kept deliberately small (what a method needs stays in that method)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from edgetrain.registry import EdgetrainError, Registry


@dataclass(frozen=True)
class Backend:
    name: str
    framework: str                      # "torch" or "mlx": which model classes it runs
    device: str                         # framework device string
    synchronize: Callable[[], None]     # wait for queued device work (timing must not stop early)
    availability: Callable[[], tuple[bool, str]]
    probe: Callable[[], str]            # the name of the memory probe that reads what this backend uses
    # The learner that drives this framework's models and the function that loads a model for it
    # (name_or_path, dtype, device) -> model, as "module:attribute": imported only when used, so that
    # registering a backend never imports its framework.
    learner: str = "edgetrain.learner:Learner"
    loader: str = "edgetrain.models:load_torch_model"

    def learner_class(self) -> type:
        return _resolve(self.learner)

    def load_model(self, name_or_path: Any, dtype: Any, device: Any) -> Any:
        return _resolve(self.loader)(name_or_path, dtype=dtype, device=device)

    def require(self) -> "Backend":
        ok, reason = self.availability()
        if not ok:
            raise EdgetrainError(f"backend {self.name!r} is not available here: {reason}")
        return self


BACKENDS: Registry[Backend] = Registry("backend")
# Names that mean a backend: "torch" is torch on the CPU unless a device says otherwise.
BACKEND_ALIASES = {"torch": "torch-cpu"}


def _resolve(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def get_backend(name: str) -> Backend:
    return BACKENDS.get(name).require()
