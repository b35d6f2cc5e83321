"""What one profiled run is: a model, a method, a backend and the step's shape."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# The fields every JSON record carries (the documented schema of `edgetrain profile --json`).
RECORD_FIELDS = ("method", "backend", "model", "seq", "batch", "rank", "peak_bytes_probe",
                 "peak_bytes_tensors", "step_seconds", "loss", "grad_cosine", "grad_max_rel_err")


@dataclass
class ProfileConfig:
    model: str = "tiny"
    method: str = "bp"
    backend: str = "torch-cpu"
    seq: int = 256
    batch: int = 1
    rank: int = 8
    steps: int = 3
    warmup: int = 1  # untimed steps first (a GPU's first steps pick kernels and grow its allocator's pools)
    dtype: str = "float32"
    seed: int = 0
    fidelity: bool = True     # compare the method's gradient with exact autograd on the same batch
    layers: int | None = None  # keep only the first N blocks (shape studies of big presets)
    method_options: dict[str, Any] = field(default_factory=dict)
    quantize_bits: int | None = None  # dense base weights quantised to N bits on load (4 = the MeSP paper's)
    dequantize: bool = False          # a GGUF's 4/8-bit matrices held dense (default: kept packed as stored)
    threads: int | str | None = None  # the learner's intra-op threads: N, "auto" (the free cores) or torch's own

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_options(self) -> Any:
        """The LoadOptions every user path builds from the same flags (edgetrain.backends.load_options)."""
        from edgetrain.backends.load_options import LoadOptions

        return LoadOptions(dequantize=self.dequantize, quantize_bits=self.quantize_bits, dtype=self.dtype)
