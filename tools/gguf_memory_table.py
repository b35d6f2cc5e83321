#!/usr/bin/env python3
"""What a model's weights occupy once loaded, per GGUF file and path: the file's tensor bytes, the torch
model's (packed matrices as held, every other tensor dense) and the MLX model's (its arrays), as MiB and as
a ratio to the file. Counted from the tensors themselves, so the figures do not move with the machine's load.

    .venv/bin/python tools/gguf_memory_table.py                          # the fixtures in tests/fixtures/gguf
    .venv/bin/python tools/gguf_memory_table.py smollm2-135m smollm2-q4_k_m.gguf   # any GGUF files

docs/gguf.md's memory table is this script's output.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Sequence

MIB = 2**20
FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "gguf"


def torch_bytes(path: Path) -> int:
    from edgetrain.models.gguf.loader import load_gguf

    model = load_gguf(path, quantized=True)
    seen: set[int] = set()
    total = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.data_ptr() not in seen and tensor.numel():
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def mlx_bytes(path: Path) -> int | None:
    try:
        from mlx.utils import tree_flatten

        from edgetrain.backends.mlx.gguf import load_gguf_mlx
    except ImportError:
        return None
    model = load_gguf_mlx(path)
    return sum(array.nbytes for _, array in tree_flatten(model.parameters()))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", help="GGUF files or download names (default: the test fixtures)")
    args = parser.parse_args(argv)
    from edgetrain.models.gguf.reader import read_gguf

    paths = [Path(m) for m in args.models] or sorted(FIXTURES.glob("*.gguf"))
    print(f"{'file':<34}{'types':<40}{'file MiB':>9}{'torch':>16}{'mlx':>16}")
    for path in paths:
        if not path.exists():
            from edgetrain.models.downloads import fetch

            path = Path(fetch(str(path)))
        file = read_gguf(path)
        tensor_bytes = sum(info.nbytes for info in file.tensors.values())
        types = Counter(info.type_name for info in file.tensors.values())
        held = torch_bytes(path)
        on_mlx = mlx_bytes(path)
        mlx_cell = f"{on_mlx / MIB:.2f} ({on_mlx / tensor_bytes:.2f}x)" if on_mlx is not None else "no mlx"
        print(f"{path.name:<34}{', '.join(f'{n} {t}' for t, n in sorted(types.items())):<40}"
              f"{tensor_bytes / MIB:>9.2f}{f'{held / MIB:.2f} ({held / tensor_bytes:.2f}x)':>16}{mlx_cell:>16}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
