"""torch on the CPU: the fallback on every device, and what CI runs."""
from __future__ import annotations

import sys

from edgetrain.backends.base import BACKENDS, Backend


def _cpu_probe_name() -> str:
    if sys.platform == "darwin":
        return "darwin"
    return "linux"


BACKENDS.add("torch-cpu", Backend(name="torch-cpu", framework="torch", device="cpu",
                                  default_probe=_cpu_probe_name(), synchronize=lambda: None,
                                  availability=lambda: (True, "")))
