"""What kind of machine this is, as far as reading memory goes: macOS, an NVIDIA Jetson, or plain Linux."""
from __future__ import annotations

import sys
from pathlib import Path


def is_jetson(tegra_release: str | Path = "/etc/nv_tegra_release",
              meminfo: str | Path = "/proc/meminfo") -> bool:
    """An NVIDIA Jetson (L4T): the release file, or the NvMap line its kernel adds to meminfo."""
    if Path(tegra_release).exists():
        return True
    try:
        return "NvMapMemUsed:" in Path(meminfo).read_text()
    except OSError:
        return False


def cpu_memory_probe() -> str:
    """The probe that reads what the OS charges a CPU process here."""
    if sys.platform == "darwin":
        return "darwin"
    # On a Jetson, CPU training still shares RAM with the GPU carve-out: read it the Jetson way.
    return "jetson" if is_jetson() else "linux"
