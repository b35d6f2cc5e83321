#!/usr/bin/env python3
"""What dequantising a packed matrix costs next to the product it feeds, per GGUF type, in one run: for one
matrix of each type in the file, the time to dequantise all its tiles (PackedMatrix.scratch_tiles, as every
layer does in the forward, MeSP's recompute and backward) over the time of x @ W.T with x of --tokens rows,
both on one thread, the fastest of --repeats rounds taken alternately.

    .venv/bin/python tools/bench_tile_dequant.py smollm2-q4_k_m.gguf smollm2-135m
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, Sequence


def _fastest(run: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="GGUF files or download names")
    parser.add_argument("--tokens", type=int, default=256, help="rows of x (batch x seq of a step)")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    import torch

    from edgetrain.models.gguf.loader import load_gguf
    from edgetrain.models.quantized import PackedMatrix

    torch.set_num_threads(1)
    print(f"{'file':<34}{'type':<8}{'matrix':>14}{'dequantise ms':>15}{'product ms':>12}{'ratio':>8}")
    for model in args.models:
        path = Path(model)
        if not path.exists():
            from edgetrain.models.downloads import fetch

            path = Path(fetch(model))
        loaded = load_gguf(path, quantized=True)
        chosen: dict[str, PackedMatrix] = {}
        for module in loaded.modules():  # a block projection of each type (the token table is read by rows)
            if isinstance(module, PackedMatrix) and module.rows < 16384:
                chosen.setdefault(module.layout.format_name or f"{module.bits}-bit", module)
        for type_name, matrix in sorted(chosen.items()):
            x = torch.randn(args.tokens, matrix.cols)
            weight = matrix.dequantize()
            dequantise = product = float("inf")
            for _ in range(3):  # alternate, so that a busy moment falls on both
                dequantise = min(dequantise, _fastest(lambda: [None for _ in matrix.scratch_tiles()], args.repeats))
                product = min(product, _fastest(lambda: x @ weight.t(), args.repeats))
            print(f"{path.name:<34}{type_name:<8}{f'{matrix.rows}x{matrix.cols}':>14}{dequantise * 1e3:>15.3f}"
                  f"{product * 1e3:>12.3f}{dequantise / product:>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
