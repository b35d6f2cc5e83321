"""NVIDIA Jetson: RAM is shared by CPU and GPU, so a training run costs its process RSS plus the
GPU buffers the NvMap driver has carved out of the same RAM.

  current = VmRSS of this process + NvMap GPU memory
NvMap GPU memory comes from jetson-stats (`jtop`, memory['RAM']['shared'], kB) when its root
service answers -- it also covers kernels without NvMapMemUsed -- else from /proc/meminfo's
NvMapMemUsed. NvMap is system-wide: on a device where other processes use the GPU it counts
their buffers too. CUDA device allocations are not mapped into the process, so RSS and NvMap do
not overlap.

Neither source keeps a high-water mark, so the peak is SAMPLED: the maximum over the readings
taken at reset_peak() / peak_bytes() / current_bytes(), plus those of an optional background
thread (sample_interval_s). A spike shorter than the interval can be missed.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from edgetrain.probes.base import PROBES, ProbeUnavailableError, is_jetson, require_available


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo as field -> bytes ("kB" values scaled; unit-less counts such as
    HugePages_Total kept as they are). Lines that do not parse are skipped."""
    fields: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        parts = rest.split()
        if not sep or not parts:
            continue
        try:
            value = int(parts[0])
        except ValueError:
            continue
        if len(parts) > 1 and parts[1] == "kB":
            value *= 1024
        fields[key.strip()] = value
    return fields


def _rss_bytes(status_path: Path) -> int:
    with open(status_path) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise ProbeUnavailableError(f"{status_path} has no VmRSS line")


@PROBES.register("jetson")
class JetsonProbe:
    """Process RSS + NvMap GPU memory on a Jetson, peak sampled (see the module docstring)."""

    name = "jetson"

    def __init__(self, *, sample_interval_s: float | None = None, use_jtop: bool = True,
                 meminfo_path: str | Path = "/proc/meminfo",
                 tegra_release_path: str | Path = "/etc/nv_tegra_release",
                 status_path: str | Path = "/proc/self/status") -> None:
        """The paths exist so tests can stand in for a Jetson's files."""
        if sample_interval_s is not None and sample_interval_s <= 0:
            raise ValueError(f"sample_interval_s must be positive, not {sample_interval_s}")
        self.sample_interval_s = sample_interval_s
        self.use_jtop = use_jtop
        self.meminfo_path = Path(meminfo_path)
        self.tegra_release_path = Path(tegra_release_path)
        self.status_path = Path(status_path)
        self.source = ""          # "jtop" or "/proc/meminfo" once chosen
        self.source_note = ""     # why jtop was not used, when it was not
        self._checked: tuple[bool, str] | None = None
        self._jtop: Any = None
        self._peak = 0
        self._lock = threading.Lock()
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()

    # -- availability and source ------------------------------------------------------------

    def available(self) -> tuple[bool, str]:
        if self._checked is None:
            self._checked = self._choose_source()
        return self._checked

    def _choose_source(self) -> tuple[bool, str]:
        try:
            meminfo = parse_meminfo(self.meminfo_path.read_text())
        except OSError as exc:
            meminfo = {}
            meminfo_error = f"cannot read {self.meminfo_path}: {exc.strerror or exc}"
        else:
            meminfo_error = ""
        if not is_jetson(self.tegra_release_path, self.meminfo_path):
            return False, (f"not an NVIDIA Jetson: no {self.tegra_release_path} and no NvMapMemUsed "
                           f"line in {self.meminfo_path}" + (f" ({meminfo_error})" if meminfo_error else ""))
        try:
            _rss_bytes(self.status_path)
        except (OSError, ProbeUnavailableError) as exc:
            return False, f"cannot read this process's VmRSS: {exc}"
        jtop_why = self._connect_jtop() if self.use_jtop else "jtop not requested (use_jtop=False)"
        if not jtop_why:
            self.source = "jtop"
            return True, ""
        self.source_note = jtop_why
        if "NvMapMemUsed" in meminfo:
            self.source = str(self.meminfo_path)
            return True, ""
        no_nvmap = meminfo_error or f"{self.meminfo_path} has no NvMapMemUsed line"
        return False, f"Jetson, but no NvMap figure: {no_nvmap}, and jtop is unusable ({jtop_why})"

    def _connect_jtop(self) -> str:
        """Connect to the jtop service; "" on success, else why not."""
        try:
            from jtop import jtop
        except ImportError as exc:
            return f"jetson-stats is not installed ({exc})"
        client = None
        try:
            client = jtop()
            client.start()
            client.memory["RAM"]["shared"]  # the service answers with the field we need
        except Exception as exc:  # noqa: BLE001 -- jtop raises its own JtopException, socket errors, ...
            if client is not None and hasattr(client, "close"):
                try:
                    client.close()
                except Exception:  # noqa: BLE001 -- already failing; the first error is the one to report
                    pass
            return f"cannot use the jtop service ({type(exc).__name__}: {exc}); is jtop.service running?"
        self._jtop = client
        return ""

    # -- readings ---------------------------------------------------------------------------

    def nvmap_bytes(self) -> int:
        """GPU memory NvMap holds, system-wide."""
        if self.source == "jtop":
            return int(self._jtop.memory["RAM"]["shared"]) * 1024
        meminfo = parse_meminfo(self.meminfo_path.read_text())
        if "NvMapMemUsed" not in meminfo:
            raise ProbeUnavailableError(f"{self.meminfo_path} no longer has an NvMapMemUsed line")
        return meminfo["NvMapMemUsed"]

    def _sample(self) -> int:
        value = _rss_bytes(self.status_path) + self.nvmap_bytes()
        with self._lock:
            self._peak = max(self._peak, value)
        return value

    def reset_peak(self) -> None:
        require_available(self)
        value = _rss_bytes(self.status_path) + self.nvmap_bytes()
        with self._lock:
            self._peak = value
        if self.sample_interval_s is not None and self._sampler is None:
            self._stop.clear()
            self._sampler = threading.Thread(target=self._sample_forever, name="edgetrain-jetson-probe",
                                             daemon=True)
            self._sampler.start()

    def peak_bytes(self) -> int:
        require_available(self)
        self._sample()
        with self._lock:
            return self._peak

    def current_bytes(self) -> int:
        require_available(self)
        return self._sample()

    def _sample_forever(self) -> None:
        while not self._stop.wait(self.sample_interval_s):
            try:
                self._sample()
            except (OSError, ProbeUnavailableError):
                return  # the foreground readings will raise with the reason

    def close(self) -> None:
        """Stop the sampling thread and disconnect from jtop."""
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join()
            self._sampler = None
        if self._jtop is not None:
            try:
                self._jtop.close()
            finally:
                self._jtop = None
                self._checked = None  # reconnect on next use
