"""List what this install offers: training methods, model presets, device targets, memory probes, formats.

    edgetrain list             # everything below, grouped under a heading each
    edgetrain list methods     # each method and the frameworks that run it
    edgetrain list models      # model presets (a checkpoint directory works too)
    edgetrain list targets     # device profiles for --target, with their memory budget
    edgetrain list probes      # memory probes, and whether each works on this machine (and why not)
    edgetrain list formats     # export runtimes and adapter formats
"""
from __future__ import annotations

import argparse
import importlib.util
from typing import Callable


def _methods() -> list[tuple[str, str]]:
    from edgetrain.backends import BACKENDS
    from edgetrain.backends.base import DEFAULT_BACKEND

    frameworks: dict[str, list[str]] = {}
    default_first = sorted(BACKENDS.names(), key=lambda name: name != DEFAULT_BACKEND)
    for backend in (BACKENDS.get(name) for name in default_first):
        if not backend.availability()[0]:
            continue  # its method registry may need the framework itself (mlx)
        for name in backend.method_registry().names():
            if backend.framework not in frameworks.setdefault(name, []):
                frameworks[name].append(backend.framework)
    return [(name, ", ".join(kinds)) for name, kinds in sorted(frameworks.items())]


def _models() -> list[tuple[str, str]]:
    from edgetrain.models import MODEL_PRESETS
    from edgetrain.models.downloads import DOWNLOADS

    rows = []
    for name in MODEL_PRESETS.names():
        doc = (getattr(MODEL_PRESETS.get(name), "__doc__", None) or "").strip().splitlines()
        rows.append((name, doc[0] if doc else ""))
    for name in DOWNLOADS.names():
        entry = DOWNLOADS.get(name)
        rows.append((name, f"pretrained, fetched once from the package index: {entry.description}, {entry.license}"))
    return rows


def _targets() -> list[tuple[str, str]]:
    from edgetrain.targets import available_targets, load_target

    rows = []
    for name in available_targets():
        target = load_target(name)
        rows.append((name, f"{target.backend}, {target.memory_budget_mib:,} MiB: {target.description}"))
    return rows


def _probes() -> list[tuple[str, str]]:
    from edgetrain.probes import PROBES

    rows = []
    for name in PROBES.names():
        ok, reason = PROBES.get(name)().available()
        rows.append((name, "available" if ok else f"unavailable: {reason}"))
    return rows


def _formats() -> list[tuple[str, str]]:
    from edgetrain.export import RUNTIMES

    rows = [(f"export: {runtime}", "installed" if importlib.util.find_spec(module) else
             "needs the export extra (pip install 'edgetrain[export]')")
            for runtime, module in zip(RUNTIMES, ("executorch", "onnxruntime"))]
    rows.append(("adapter: edgetrain", "LoRA adapter as .safetensors with its config (torch)"))
    rows.append(("adapter: mlx-lm", "mlx-lm adapter directory (adapters.safetensors + adapter_config.json)"))
    rows.append(("adapter: peft", "Hugging Face PEFT LoRA directory (adapter_config.json + adapter_model.safetensors; "
                                  "edgetrain.adapters.peft, --adapter of generate and eval)"))
    return rows


def _gguf() -> list[tuple[str, str]]:
    """Each GGUF tensor type edgetrain reads, and what each path holds it as (docs/gguf.md has the memory)."""
    from edgetrain.cli.gguf_support import gguf_type_support
    from edgetrain.models import tile_kernel

    return [(name, " | ".join(f"{path}: {how}" for path, how in paths.items()))
            for name, paths in gguf_type_support().items()] + [
        ("dequantising", f"torch on a CPU: {tile_kernel.status()}")]


# what -> the rows it lists
LISTINGS: dict[str, Callable[[], list[tuple[str, str]]]] = {
    "methods": _methods, "models": _models, "targets": _targets, "probes": _probes, "formats": _formats,
    "gguf": _gguf}


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=sorted(LISTINGS), nargs="?", default=None,
                        help="what to list (default: everything, grouped)")


def _print_rows(rows: list[tuple[str, str]]) -> None:
    width = max((len(name) for name, _ in rows), default=0)
    for name, about in rows:
        print(f"{name:<{width}}  {about}".rstrip())


def main(args: argparse.Namespace) -> int:
    if args.what is not None:
        _print_rows(LISTINGS[args.what]())
        return 0
    for index, (what, rows) in enumerate((what, listing()) for what, listing in LISTINGS.items()):
        print(("\n" if index else "") + f"{what}:")
        _print_rows(rows)
    return 0
