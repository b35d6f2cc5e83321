"""Convert a LoRA adapter to the format another runtime reads: PEFT (transformers), mlx-lm, llama.cpp's
LoRA GGUF, or edgetrain's own file. The source format is detected; the weights are copied exactly.

    edgetrain export-adapter --adapter adapter.safetensors --format peft -o my-adapter/
    edgetrain export-adapter --adapter my-adapter/ --format mlx-lm -o mlx-adapter/
    edgetrain export-adapter --model smollm2-135m --adapter adapter.safetensors --format gguf -o lora.gguf

--model names the base model (as load_model does; only its config is read): a GGUF adapter needs it
(tensor names and Q/K row order follow the base), and with it every format is checked to fit the base.
"""
from __future__ import annotations

import argparse


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from edgetrain.adapters.formats import FORMATS

    parser.add_argument("--adapter", required=True,
                        help="the adapter: an edgetrain file, a llama.cpp .gguf adapter, a PEFT or mlx-lm directory")
    parser.add_argument("--format", required=True, choices=FORMATS, help="the format to write")
    parser.add_argument("-o", "--out", required=True,
                        help="the file (edgetrain, gguf) or directory (peft, mlx-lm) to write")
    parser.add_argument("--model", default=None,
                        help="the base model (preset, pretrained name, checkpoint directory or .gguf): needed "
                             "for gguf, recorded in PEFT's base_model_name_or_path, and checked against")
    parser.add_argument("--base-model", default=None,
                        help="the name recorded as the base model when it differs from --model")
    return parser


def main(args: argparse.Namespace) -> int:
    from edgetrain.adapters.convert import convert_adapter, detect_format
    from edgetrain.utils.logs import get_logger
    from edgetrain.utils.progress import begin_stage

    base_config = None
    if args.model is not None:
        from edgetrain.models.decoder_config import decoder_config

        begin_stage(f"reading the config of {args.model}")  # a pretrained name is fetched first, once
        base_config = decoder_config(args.model)
    begin_stage(f"converting {args.adapter} to {args.format}")
    source_format = detect_format(args.adapter)
    written = convert_adapter(args.adapter, args.out, args.format, base_model=args.base_model or args.model,
                              base_config=base_config)
    get_logger(__name__).info("wrote %s (%s, from %s)", written, args.format, source_format)
    print(written)
    return 0
