"""What each path does with each GGUF tensor type, from the block table (edgetrain.models.gguf.blocks) and
each path's own rule: `edgetrain list gguf`, docs/gguf.md and the loaders' refusals agree because they all
read these."""
from __future__ import annotations

from edgetrain.models.gguf.blocks import BLOCK_FORMATS
from edgetrain.models.gguf.ggml_types import GGML_TYPES

FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}
# The paths by what a user runs (labels, not backend names: each path's rule is its own function below).
ON_TORCH, ON_MLX, NATIVE = "torch", "MLX", "native program"
PATHS = (ON_TORCH, ON_MLX, NATIVE)


def _mlx(type_id: int) -> str:
    from edgetrain.models.gguf.packed import PACKABLE_TYPES

    fmt = BLOCK_FORMATS[type_id]
    if type_id in PACKABLE_TYPES:
        return f"packed ({fmt.bits}-bit groups of 32)"
    why = "a non-uniform grid" if fmt.codebook is not None else f"groups of {fmt.group_size}"
    return f"dequantised ({why}; logged at load)"


def _native(type_id: int) -> str:
    from edgetrain.export.mesp_program import program_reads
    from edgetrain.models.quantized import layout_of

    fmt = BLOCK_FORMATS[type_id]
    if not program_reads(layout_of(fmt)):
        return "dense float32 (converted at export, said once)"
    # The program's int8 layouts (edgetrain/export/mesp_graph.py MatrixFormat), for a matrix whose rows split
    # evenly (4 rows for row quarters, 2 for row halves; every GGUF matrix's do).
    codes = {8: "a code a byte", 5: "three bytes for four codes", 6: "three bytes for four codes"}.get(
        fmt.bits, "two codes a byte")
    return f"packed ({codes}; dequantised a tile at a time in the block programs)"


def gguf_type_support() -> dict[str, dict[str, str]]:
    """type name -> path -> how that path holds a tensor of it; then one row for every other ggml type."""
    rows: dict[str, dict[str, str]] = {name: {path: "dense" for path in PATHS} for name in FLOAT_TYPES.values()}
    for type_id, fmt in BLOCK_FORMATS.items():
        rows[fmt.name] = dict(zip(PATHS, (f"packed ({fmt.bits}-bit codes, groups of {fmt.group_size})",
                                          _mlx(type_id), _native(type_id))))
    others = sorted(name for type_id, (name, _, _) in GGML_TYPES.items()
                    if type_id not in BLOCK_FORMATS and type_id not in FLOAT_TYPES)
    rows["others"] = {"every path": f"refused by name at load ({', '.join(others)})"}
    return rows
