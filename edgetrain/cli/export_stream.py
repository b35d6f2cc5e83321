"""The batches `edgetrain export` checks an export with and writes for the native runners."""
from __future__ import annotations

import argparse
from typing import Any


def batch_stream(model: Any, args: argparse.Namespace) -> Any:
    """--data (text for decoders, digits for classifiers by default) in --batch x --seq batches from --seed."""
    from edgetrain.data import make_stream

    name = args.data or ("text" if getattr(model, "task", None) == "lm" else "digits")
    options = {"batch_size": args.batch, "seed": args.seed}
    if getattr(model, "task", None) == "lm":
        options.update(seq_len=args.seq, vocab_size=model.config.vocab_size)
    return make_stream(name, **options)


