"""Write text with a model (and its LoRA adapter): the continuation of --prompt, greedy or sampled.

    edgetrain generate --model smollm2-135m --prompt "The capital of France is"
    edgetrain generate --model smollm2-135m --adapter adapter.safetensors --prompt "..." --temperature 0.7
    edgetrain generate --backend mlx --model model.gguf --prompt "..."   # MLX, 4/8-bit weights kept packed

Tokens come from the model's own tokenizer; a key/value cache keeps each new token's cost flat. The text
goes to stdout.
"""
from __future__ import annotations

import argparse

from edgetrain.cli.model_args import add_model_flags, load_model_and_adapter, text_functions


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_model_flags(parser)
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-tokens", type=int, default=64, help="at most this many new tokens")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample only from this much probability mass")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    return parser


def main(args: argparse.Namespace) -> int:
    text = text_functions(args)  # the backend's own generation (torch or MLX, both with a key/value cache)
    model = load_model_and_adapter(args)
    print(text.generate(model, args.prompt, args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                   seed=args.seed))
    return 0
