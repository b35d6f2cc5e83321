"""How a model's frozen base is held in memory: the one choice every path that loads a model makes.

The CLI (`train`, `eval`, `generate`, `profile`, `personalise run`, `export --merge`), the Personaliser
and `load_model` all build a LoadOptions and hand it to `edgetrain.load_model`; none of them decides the
base's format on its own.

- **packed, the default.** A GGUF's Q4_0, Q4_1 and Q8_0 matrices (block projections, token embedding,
  untied LM head) stay as the file stores them, the file's own integers and scales, and are dequantised
  one tile at a time while they compute (edgetrain.models.quantized on torch, MLX's quantized kernels on
  MLX), as llama.cpp and mlx-lm keep a quantised model. A tensor of a type edgetrain cannot keep packed
  (the K-quants and i-quants, F16, BF16) is dequantised to `dtype`, with one log line per load naming
  them: refusing would turn away most GGUFs on the Hub, and the log says what the memory figures hold.
- **`dequantize=True`** (`--dequantize`) holds every weight dense in `dtype`: the reference, and what
  merging an adapter into the base needs.
- **`quantize_bits=N`** (`--quantize-bits N`) quantises the matrices that are dense after loading
  (group-wise affine; torch: 4 or 8 bits, MLX: 2, 3, 4, 6 or 8): an fp32/bf16 checkpoint or preset, or a
  GGUF's tensors that could not stay packed. Packed tensors are never quantised twice; with
  `dequantize=True` too, every matrix is requantised from the file's dequantised values.
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Any

from edgetrain.registry import EdgetrainError

# What any backend's quantiser may accept; each backend refuses what it does not support by name.
QUANTIZE_BITS = (2, 3, 4, 6, 8)
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16"}


class LoadOptionsError(EdgetrainError):
    """Load options that name no valid way to hold a base model."""


@dataclass(frozen=True)
class LoadOptions:
    dequantize: bool = False          # hold a GGUF's packed matrices dense in `dtype` (default: kept packed)
    quantize_bits: int | None = None  # quantise the matrices still dense after loading, to this many bits
    dtype: str = "float32"            # dense weights, norms, and what packed weights dequantise to

    def __post_init__(self) -> None:
        if not isinstance(self.dequantize, bool):
            raise LoadOptionsError(f"dequantize must be True or False, got {self.dequantize!r}")
        bits = self.quantize_bits
        if bits is not None and (isinstance(bits, bool) or not isinstance(bits, int) or bits not in QUANTIZE_BITS):
            raise LoadOptionsError(f"quantize_bits must be one of {', '.join(map(str, QUANTIZE_BITS))} or None, "
                                   f"got {bits!r}")
        name = DTYPE_NAMES.get(self.dtype) if isinstance(self.dtype, str) else _torch_dtype_name(self.dtype)
        if name is None:
            raise LoadOptionsError(f"unknown dtype {self.dtype!r}; known: {', '.join(DTYPE_NAMES)}")
        object.__setattr__(self, "dtype", name)  # one spelling, so that records compare equal

    @classmethod
    def of(cls, dtype: Any = None, quantized: bool | None = None, quantize_bits: int | None = None) -> "LoadOptions":
        """From load_model's keywords: `quantized=False` asks for the dense base (True and None: packed)."""
        if quantized is not None and not isinstance(quantized, bool):
            raise LoadOptionsError(f"quantized must be True, False or None, got {quantized!r}")
        return cls(dequantize=quantized is False, quantize_bits=quantize_bits,
                   dtype="float32" if dtype is None else dtype)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "LoadOptions":
        """From the flags add_load_flags added (a subcommand without one of them gets its default)."""
        return cls(dequantize=bool(getattr(args, "dequantize", False)),
                   quantize_bits=getattr(args, "quantize_bits", None),
                   dtype=getattr(args, "dtype", None) or "float32")

    @classmethod
    def asked_for(cls, args: argparse.Namespace) -> "LoadOptions | None":
        """from_args, or None when none of the flags was given (add_load_flags(dtype_default=None)): a
        Personaliser then holds a new store's base packed and an existing store's base as it was created."""
        if not getattr(args, "dequantize", False) and getattr(args, "quantize_bits", None) is None \
                and getattr(args, "dtype", None) is None:
            return None
        return cls.from_args(args)

    @classmethod
    def from_record(cls, record: dict[str, Any] | None, where: str) -> "LoadOptions":
        """From to_record()'s dict, as a store keeps it; None (a record from before the options were kept)
        is the default. A damaged record is refused naming `where`."""
        if record is None:
            return cls()
        if not isinstance(record, dict) or set(record) - {"dequantize", "quantize_bits", "dtype"}:
            raise LoadOptionsError(f"{where}: load options {record!r} are not a record LoadOptions wrote")
        try:
            return cls(**record)
        except LoadOptionsError as exc:
            raise LoadOptionsError(f"{where}: {exc}") from None

    def to_record(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """How the base is held, for logs and reports."""
        held = f"dequantised to {self.dtype}" if self.dequantize else "kept as stored"
        return held + (f", dense matrices in {self.quantize_bits} bits" if self.quantize_bits else "")


def _torch_dtype_name(dtype: Any) -> str | None:
    text = str(dtype)  # torch.float32 -> "torch.float32", without importing torch here
    return DTYPE_NAMES.get(text.removeprefix("torch.")) if text.startswith("torch.") else None


def add_load_flags(parser: argparse.ArgumentParser, dtype_default: str | None = "float32") -> None:
    """--dtype, --dequantize and --quantize-bits: how the base model is held (LoadOptions.from_args)."""
    parser.add_argument("--dtype", default=dtype_default, help="dense weights' dtype (float32, bfloat16, float16)")
    parser.add_argument("--dequantize", action="store_true",
                        help="hold a GGUF's 4- and 8-bit weights dense in --dtype (default: kept packed as stored, "
                             "dequantised one tile at a time while they compute)")
    parser.add_argument("--quantize-bits", type=int, default=None, metavar="N", choices=QUANTIZE_BITS,
                        help="quantise the base's dense matrices on load to N bits (torch: 4 or 8; MLX: 2, 3, 4, "
                             "6 or 8): an fp32/bf16 checkpoint or preset kept small")
