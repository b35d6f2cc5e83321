"""Convert a LoRA adapter to the format another runtime reads: PEFT (transformers), mlx-lm, or edgetrain's
own file. The source format is detected; the weights are copied exactly.

    edgetrain export-adapter --adapter adapter.safetensors --format peft --out my-adapter/
    edgetrain export-adapter --adapter my-adapter/ --format mlx-lm --out mlx-adapter/
"""
from __future__ import annotations

import argparse


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from edgetrain.adapters.formats import FORMATS

    parser.add_argument("--adapter", required=True, help="the adapter: an edgetrain file, a PEFT or mlx-lm directory")
    parser.add_argument("--format", required=True, choices=FORMATS, help="the format to write")
    parser.add_argument("--out", required=True, help="the file (edgetrain) or directory (peft, mlx-lm) to write")
    parser.add_argument("--base-model", default=None, help="recorded in a PEFT config as base_model_name_or_path")
    return parser


def main(args: argparse.Namespace) -> int:
    from edgetrain.adapters.convert import convert_adapter, detect_format
    from edgetrain.logs import get_logger

    source_format = detect_format(args.adapter)
    written = convert_adapter(args.adapter, args.out, args.format, base_model=args.base_model)
    get_logger(__name__).info("wrote %s (%s, from %s)", written, args.format, source_format)
    print(written)
    return 0
