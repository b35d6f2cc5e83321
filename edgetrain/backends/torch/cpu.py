"""torch on the CPU: the fallback on every device, and what CI runs."""
from __future__ import annotations

from edgetrain.backends.base import BACKENDS, Backend
from edgetrain.backends.host import cpu_memory_probe

BACKENDS.add("torch-cpu", Backend(name="torch-cpu", framework="torch", device="cpu",
                                  synchronize=lambda: None,
                                  availability=lambda: (True, ""), probe=cpu_memory_probe, quantized_base=True))
