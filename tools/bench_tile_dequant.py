#!/usr/bin/env python3
"""What dequantising a packed matrix costs next to the product it feeds, per GGUF type, in one run: for one
matrix of each type in the file, the time to dequantise all its tiles (PackedMatrix.scratch_tiles, as every
layer does in the forward, MeSP's recompute and backward) with the compiled tile kernel and with torch's
kernels (edgetrain.models.tile_kernel), each over the time of x @ W.T with x of --tokens rows, all on one
thread, the fastest of --repeats rounds taken alternately.

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

    from edgetrain.models import tile_kernel
    from edgetrain.models.gguf.loader import load_gguf
    from edgetrain.models.quantized import PackedMatrix

    torch.set_num_threads(1)
    if not tile_kernel.available():
        print(f"note: {tile_kernel.status()}; both dequantisation columns are torch's kernels")
    print(f"{'':<56}{'compiled kernel':>17}{'torch kernels':>17}")
    print(f"{'file':<34}{'type':<8}{'matrix':>14}{'ms':>10}{'/ prod':>7}{'ms':>10}{'/ prod':>7}{'product ms':>12}")
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
            compiled = torch_kernels = product = float("inf")

            def tiles() -> None:
                # The tiles a layer takes on this CPU (tile_elements: larger with the compiled kernel).
                for _ in matrix.scratch_tiles():
                    pass
            for _ in range(3):  # alternate, so that a busy moment falls on every arm
                compiled = min(compiled, _fastest(tiles, args.repeats))
                with tile_kernel.kernel_enabled(False):
                    torch_kernels = min(torch_kernels, _fastest(tiles, args.repeats))
                product = min(product, _fastest(lambda: x @ weight.t(), args.repeats))
            print(f"{path.name:<34}{type_name:<8}{f'{matrix.rows}x{matrix.cols}':>14}{compiled * 1e3:>10.3f}"
                  f"{compiled / product:>7.2f}x{torch_kernels * 1e3:>10.3f}{torch_kernels / product:>7.2f}x"
                  f"{product * 1e3:>12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
