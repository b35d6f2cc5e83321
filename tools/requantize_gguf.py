"""Requantise a GGUF with llama.cpp's own quantizer: the file's weights dequantised exactly to F32, then
llama_model_quantize to the file type asked for (what llama-quantize does). How docs/gguf.md makes the
SmolLM2-135M Q4_K_M file its measurements use from the Q4_1 file edgetrain downloads:

    CMAKE_ARGS="-DGGML_NATIVE=OFF" .venv/bin/pip install 'edgetrain[llamacpp]'   # compiles llama.cpp
    .venv/bin/python tools/requantize_gguf.py --model smollm2-135m --type Q4_K_M --out smollm2-q4_k_m.gguf

The result holds what llama.cpp chooses for that type on this model; it is listed tensor type by count.
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
from collections import Counter
from pathlib import Path


def requantize(source: Path, out: Path, file_type: str) -> Counter:
    """Write `source` requantised to llama.cpp's `file_type` (Q4_K_M, Q6_K, ...) at `out`; its tensor types."""
    import llama_cpp
    from gguf import GGUFReader

    from edgetrain.export.merged import save_merged_gguf
    from edgetrain.models.gguf.loader import load_gguf

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{file_type}", None)
    if ftype is None:
        raise SystemExit(f"llama.cpp has no file type {file_type!r}")
    model = load_gguf(source)  # every weight dequantised to float32, exactly
    with tempfile.TemporaryDirectory() as scratch:
        f32 = save_merged_gguf(model, source, Path(scratch) / "f32.gguf", dtype="f32")
        del model
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftype
        params.nthread = 2
        status = llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode(), ctypes.byref(params))
    if status != 0:
        raise SystemExit(f"llama_model_quantize failed (status {status})")
    return Counter(t.tensor_type.name for t in GGUFReader(str(out)).tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a GGUF file, or a download name (smollm2-135m)")
    parser.add_argument("--type", required=True, help="llama.cpp file type: Q4_K_M, Q5_K_M, Q6_K, Q3_K_M, Q2_K, ...")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    source = Path(args.model)
    if not source.exists():
        from edgetrain.models.downloads import fetch

        source = Path(fetch(args.model))
    types = requantize(source, args.out, args.type)
    print(f"{args.out}: {args.out.stat().st_size / 2 ** 20:.1f} MiB, "
          + ", ".join(f"{n} x {t}" for t, n in sorted(types.items())))
    return None


if __name__ == "__main__":
    sys.exit(main())
