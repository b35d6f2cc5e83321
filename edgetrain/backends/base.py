"""Backend adapters: where tensors live and how to wait for the device (edgetrain.probes picks the
probe that reads its memory).

Kept deliberately small (what a method needs stays in that method)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from edgetrain.registry import EdgetrainError, Registry


@dataclass(frozen=True)
class Backend:
    name: str
    framework: str                      # "torch" or "mlx": which model classes it runs
    device: str                         # framework device string
    synchronize: Callable[[], None]     # wait for queued device work (timing must not stop early)
    availability: Callable[[], tuple[bool, str]]
    # The learner that drives this framework's models, as "module:Class": imported only when a learner
    # for this backend is made, so that registering a backend never imports its framework.
    learner: str = "edgetrain.learner:Learner"

    def learner_class(self) -> type:
        module, _, name = self.learner.partition(":")
        return getattr(importlib.import_module(module), name)

    def require(self) -> "Backend":
        ok, reason = self.availability()
        if not ok:
            raise EdgetrainError(f"backend {self.name!r} is not available here: {reason}")
        return self


BACKENDS: Registry[Backend] = Registry("backend")


def get_backend(name: str) -> Backend:
    return BACKENDS.get(name).require()
