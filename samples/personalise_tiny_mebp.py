"""Personalise a small decoder on a local text stream with `mebp`, the way an app would on a device.

The user's text (files or directories of *.txt given on the command line; by default Python's own
pydoc topics, real English that needs no download) is cut into token windows and streamed one batch
at a time. The `tiny` preset gets LoRA adapters on every projection, and only the adapters learn.
Training resumes from `--checkpoint-dir` when the app was killed, and the adapter is written
atomically at the end. Held-out perplexity (the last windows of the text, never trained on) is printed
before and after.

    python samples/personalise_tiny_mebp.py                         # pydoc topics, 200 steps
    python samples/personalise_tiny_mebp.py ~/notes --steps 500     # your own text
    python samples/personalise_tiny_mebp.py --steps 20              # a quick look (what the test runs)
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

import edgetrain
from edgetrain.data import default_text_corpus, find_text_files, text_stream


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="text files or directories (default: pydoc topics)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0, help="seed of the adapter's initialisation")
    parser.add_argument("--held-out-fraction", type=float, default=0.05, help="end of the text kept for evaluation")
    parser.add_argument("--eval-batches", type=int, default=8, help="held-out batches evaluated")
    parser.add_argument("--checkpoint-dir", default=None, help="resume from / checkpoint to this directory")
    parser.add_argument("--adapter", default="adapter.safetensors", help="where the trained adapter goes")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.paths:
        files = find_text_files(args.paths)
        text = "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    else:
        text = default_text_corpus()
    # Hold out the end of the text: the training stream never sees it.
    cut = int(len(text) * (1 - args.held_out_fraction))
    model = edgetrain.load_model("tiny")
    # LoRA's A matrices start random: seeded, two runs of the sample print the same numbers.
    torch.manual_seed(args.seed)
    edgetrain.add_lora(model, rank=args.rank)
    train = text_stream(seq_len=args.seq, batch_size=args.batch, text=text[:cut], shuffle=True, seed=0,
                        vocab_size=model.config.vocab_size)
    held_out = list(itertools.islice(text_stream(seq_len=args.seq, batch_size=args.batch, text=text[cut:],
                                                 vocab_size=model.config.vocab_size, epochs=1),
                                     args.eval_batches))

    learner = edgetrain.Learner(model, method="mebp", optimizer="adamw", lr=args.lr)
    if args.checkpoint_dir and Path(args.checkpoint_dir).is_dir():
        learner.resume(args.checkpoint_dir)
    before = learner.evaluate(held_out)
    print(f"held-out perplexity before: {before['perplexity']:.2f}")
    learner.fit(train, max_steps=args.steps, checkpoint_every=50 if args.checkpoint_dir else 0,
                checkpoint_dir=args.checkpoint_dir, log_every=max(1, args.steps // 10))
    after = learner.evaluate(held_out)
    print(f"held-out perplexity after {learner.steps_done} steps: {after['perplexity']:.2f}")
    edgetrain.save_lora(model, args.adapter)
    print(f"adapter written to {args.adapter}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
