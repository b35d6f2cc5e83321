"""Personalise a LoRA adapter on a Mac with MLX MeSP, from your own text files.

Streams fixed-length windows of text from local files (a list of files or a directory of *.txt;
default: the help topics that ship with Python) through a decoder with a 4-bit base and a LoRA
adapter trained by `mesp` -- exact gradients, one block's activations alive at a time -- and prints
the loss and the peak memory of every step (MLX's allocator, above the pre-step baseline). The
adapter is written in mlx-lm's format, so `mlx_lm.generate --adapter-path` can use it.

    python samples/mac_mlx_mesp.py ~/notes --model ~/models/Qwen2.5-0.5B-Instruct --steps 200
    python samples/mac_mlx_mesp.py --quick      # a few steps on the `tiny` preset (what the test runs)

--model takes a Hugging Face-format checkpoint directory (config.json, *.safetensors and
tokenizer.json, e.g. Qwen2.5-0.5B-Instruct) or a preset name (random weights: a memory and speed
demo, nothing to personalise).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import edgetrain.backends.mlx  # noqa: F401  (registers the mlx backend)
from edgetrain import Learner
from edgetrain.backends.mlx.adapters import save_mlx_lm_adapters
from edgetrain.backends.mlx.loading import load_mlx_model
from edgetrain.backends.mlx.lora import add_lora
from edgetrain.data.text import TextStream
from edgetrain.data.tokenizer import load_tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="text files or directories of *.txt (default: Python's pydoc topics)")
    parser.add_argument("--model", default="qwen2.5-0.5b", help="checkpoint directory or preset name")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seq", type=int, default=256, help="tokens per window (the paper's 256)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--bits", type=int, default=4, help="base weight bits (0: keep the checkpoint's dtype)")
    parser.add_argument("--out", default="adapters", help="adapter directory (mlx-lm format)")
    parser.add_argument("--quick", action="store_true", help="a few steps on the tiny preset")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.steps, args.seq, args.rank = "tiny", 4, 64, 4
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    checkpoint = Path(args.model).is_dir()
    tokenizer = load_tokenizer(args.model if checkpoint else None)
    model = load_mlx_model(args.model, quantize_bits=args.bits or None)
    add_lora(model, rank=args.rank)
    stream = TextStream(paths=args.paths or None, seq_len=args.seq, tokenizer=tokenizer,
                        vocab_size=model.config.vocab_size, shuffle=True)
    learner = Learner(model, backend="mlx", method="mesp", optimizer="adamw", lr=args.lr,
                         method_options={"fused_update": True}, probe="mlx")
    print(f"model {args.model} ({len(model.blocks)} blocks, {args.bits or 'full'}-bit base), LoRA rank "
          f"{args.rank}, {stream.batches_per_epoch} windows of {args.seq} tokens", flush=True)
    for batch in stream:
        if learner.steps_done >= args.steps:
            break
        stats = learner.step(batch)
        peak = "n/a" if stats.peak_bytes is None else f"{stats.peak_bytes / 2**20:.1f} MiB"
        print(f"step {stats.step:4d}  loss {stats.loss:.4f}  peak {peak}  {stats.seconds:.2f} s", flush=True)
    directory = save_mlx_lm_adapters(model, args.out, extra_config={"model": str(args.model)})
    print(f"adapter written to {directory} (mlx-lm format)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
