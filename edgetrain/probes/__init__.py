"""Memory probes: what the OS or the allocator really charges, one probe per source.

    probe = PROBES.get("linux")()            # or default_probe("torch-cpu")
    ok, why = probe.available()              # never raises; says why not
    peak = measure(probe, lambda: step(batch))   # peak bytes above the pre-step baseline
"""
# Importing each module registers its probe.
from edgetrain.probes import cuda, darwin, jetson, linux, mlx_probe, tensors  # noqa: F401
from edgetrain.probes.base import (PROBES, Measurement, MemoryProbe, ProbeUnavailableError,
                                   default_probe, default_probe_name, is_jetson, measure, measuring,
                                   require_available)
from edgetrain.probes.cuda import CudaProbe
from edgetrain.probes.darwin import DarwinProbe, decode_rusage_info_v4
from edgetrain.probes.jetson import JetsonProbe, parse_meminfo
from edgetrain.probes.glibc import fix_malloc_mmap_threshold, malloc_threshold_env
from edgetrain.probes.linux import LinuxProbe
from edgetrain.probes.mlx_probe import MlxProbe
from edgetrain.probes.tensors import TensorAccountant, TensorMemoryReport

__all__ = ["PROBES", "CudaProbe", "DarwinProbe", "JetsonProbe", "LinuxProbe", "Measurement", "MemoryProbe",
           "MlxProbe", "ProbeUnavailableError", "TensorAccountant", "TensorMemoryReport",
           "decode_rusage_info_v4", "default_probe", "default_probe_name", "fix_malloc_mmap_threshold",
           "is_jetson", "malloc_threshold_env", "measure", "measuring", "parse_meminfo", "require_available"]
