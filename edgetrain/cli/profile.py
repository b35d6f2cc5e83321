"""Measure what a training step costs in memory and time, method by method.

Each method runs in a fresh subprocess after a warm-up step. Memory is what a step adds above the
pre-step baseline (the model's weights are excluded), read by the OS/allocator probe of the backend and by
tensor accounting; gradient fidelity compares each method's gradient with the fp64 reference, bp on a
float64 copy of the model, on the same batch and weights (so fp32 bp has an error of its own too).
"""
from __future__ import annotations

import argparse

from edgetrain.backends.load_options import add_load_flags
from edgetrain.training.threads import threads_flag

# The first method is the ratio reference. mesp needs a LoRA decoder; the forward-gradient methods
# train every weight of small vision/text classifiers.
DEFAULT_METHODS = {"lm": "bp,mebp,mezo,mesp", "classify": "bp,mebp,mezo,fgd,asyncfgd"}


def model_task(name_or_path: str) -> str:
    """"lm" or "classify" for a preset name or checkpoint directory, without allocating weights."""
    from pathlib import Path

    from edgetrain.models.meta_build import meta_without_init
    from edgetrain.models.zoo import MODEL_PRESETS

    if Path(name_or_path).is_dir():
        return "lm"  # checkpoint directories hold HF-format decoders
    with meta_without_init():
        return MODEL_PRESETS.get(name_or_path)().task


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default="tiny", help="preset name or checkpoint directory (default: tiny)")
    parser.add_argument("--methods", default=None,
                        help=f"comma-separated methods, first is the ratio reference (default: "
                             f"{DEFAULT_METHODS['lm']} for language models, {DEFAULT_METHODS['classify']} "
                             "for classifiers)")
    parser.add_argument("--backend", default="torch-cpu", help="torch-cpu, torch-cuda or mlx")
    parser.add_argument("--seq", type=int, default=256, help="sequence length (language models)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (language models)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (more on a GPU: its first "
                                                              "steps choose kernels and grow the allocator's pools)")
    add_load_flags(parser)
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N blocks")
    # Packed is the default now; the old switch stays accepted so that scripts keep working.
    parser.add_argument("--quantized", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-fidelity", action="store_true",
                        help="skip the gradient comparison with the fp64 reference (bp on a float64 copy)")
    parser.add_argument("--target", default=None, help="device profile from targets/ (budget warning)")
    parser.add_argument("--threads", default=None, type=threads_flag, metavar="N|auto",
                        help="intra-op threads of the profiled steps: a number, or auto for the cores other processes "
                             "leave free, checked between steps (default: torch's own)")
    parser.add_argument("--json", default=None, metavar="FILE", help="write one JSON record per method")
    parser.add_argument("--plot", default=None, metavar="FILE", help="write a PNG bar chart")
    return parser


def _check_positive(name: str, value: int | None) -> None:
    from edgetrain.registry import EdgetrainError

    if value is not None and value <= 0:
        raise EdgetrainError(f"--{name} must be positive, got {value}")


def main(args: argparse.Namespace) -> int:
    from edgetrain.models import parse_dtype
    from edgetrain.profiler.config import ProfileConfig
    from edgetrain.profiler.report import format_table, write_json, write_plot
    from edgetrain.profiler.runner import run_isolated

    for name in ("seq", "batch", "rank", "steps", "warmup", "layers"):
        _check_positive(name, getattr(args, name))
    parse_dtype(args.dtype)
    from edgetrain.backends import BACKENDS, get_backend

    backend = get_backend(args.backend)
    methods_here = backend.method_registry()
    if args.quantized and args.dequantize:
        from edgetrain.registry import EdgetrainError

        raise EdgetrainError("--quantized (kept packed: the default) and --dequantize ask for opposite bases")
    if args.quantize_bits is not None and not backend.quantized_base:
        from edgetrain.registry import EdgetrainError

        able = [name for name in BACKENDS.names() if BACKENDS.get(name).quantized_base]
        raise EdgetrainError(f"--quantize-bits is for a backend that holds the base quantised ({', '.join(able)}); "
                             f"{args.backend!r} does not")
    if args.methods is None:
        methods = [m for m in DEFAULT_METHODS[model_task(args.model)].split(",") if m in methods_here]
    else:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        for method in methods:
            methods_here.get(method)  # unknown names fail here, listing the known ones
    target = None
    if args.target:
        from edgetrain.targets import load_target

        target = load_target(args.target)
    from edgetrain.utils.logs import get_logger
    from edgetrain.utils.progress import progress_bar

    log = get_logger(__name__)
    records = []
    with progress_bar(len(methods), description="profile", unit="method", enabled=not args.quiet) as bar:
        for index, method in enumerate(methods, start=1):
            log.info("[%d/%d] %s on %s", index, len(methods), method, args.model)
            config = ProfileConfig(model=args.model, method=method, backend=args.backend, seq=args.seq,
                                   batch=args.batch, rank=args.rank, steps=args.steps, warmup=args.warmup,
                                   dtype=args.dtype,
                                   layers=args.layers, fidelity=not args.no_fidelity,
                                   quantize_bits=args.quantize_bits, dequantize=args.dequantize,
                                   threads=args.threads)
            records.append(run_isolated(config, on_progress=lambda line: log.info("    %s", line)))
            bar.update()
    print(format_table(records))
    if target is not None:
        for line in target.budget_warnings(records):
            print(line)
    if args.json:
        log.info("wrote %s", write_json(records, args.json))
    if args.plot:
        log.info("wrote %s", write_plot(records, args.plot))
    return 0
