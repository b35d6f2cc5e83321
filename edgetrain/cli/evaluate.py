"""Held-out loss and perplexity of a model (and its LoRA adapter) on text files it did not train on.

    edgetrain eval --model smollm2-135m --adapter adapter.safetensors --data held-out.txt

The files are tokenised with the model's own tokenizer and cut into windows of --seq tokens (a tail
shorter than one window is left out); the result is the mean next-token cross-entropy over every
predicted token, in nats, and its exponential. One JSON line on stdout. JSONL files (*.jsonl) are read
record by record as training reads them (edgetrain.data.jsonl_stream): a chat record's loss is over its
assistant turns only.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from typing import Any

from edgetrain.backends.load_options import LoadOptions
from edgetrain.cli.model_args import add_model_flags, load_model_and_adapter, text_functions

# Without a terminal (no bar), a long evaluation says how far it is at every tenth of its batches.
_LOG_FRACTION = 10


def counted(batches: Iterator[Any], bar: Any, log: Any, total: int) -> Iterator[Any]:
    """`batches`, advancing `bar` after each and logging every tenth of `total` when no bar is shown."""
    every = max(total // _LOG_FRACTION, 1)
    for done, batch in enumerate(batches, start=1):
        yield batch
        bar.update()
        if getattr(bar, "disable", True) and done % every == 0 and done < total:
            log.info("evaluated %d of %d batches", done, total)


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_model_flags(parser)
    parser.add_argument("--data", nargs="+", required=True, metavar="FILE",
                        help="text (*.txt) or JSONL (*.jsonl) files, or directories of them (held out from "
                             "training)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per window")
    parser.add_argument("--batch", type=int, default=4, help="windows per forward pass")
    parser.add_argument("--max-batches", type=int, default=None, help="evaluate at most this many batches")
    return parser


def main(args: argparse.Namespace) -> int:
    import itertools

    from edgetrain.data import text_stream
    from edgetrain.data.binary import check_text_file
    from edgetrain.data.files import find_text_files
    from edgetrain.data.tokenizer import model_tokenizer
    from edgetrain.registry import EdgetrainError
    from edgetrain.utils.logs import get_logger
    from edgetrain.utils.progress import begin_stage, progress_bar

    if args.max_batches is not None and args.max_batches < 1:
        raise EdgetrainError(f"--max-batches must be at least 1, got {args.max_batches}")
    text = text_functions(args)  # the backend's own held_out_loss (torch or MLX)
    for path in find_text_files(args.data):  # missing or binary data is refused before the model loads
        check_text_file(path)
    model = load_model_and_adapter(args)
    begin_stage("reading and tokenizing the data")
    stream = text_stream(args.seq, args.batch, paths=args.data, tokenizer=model_tokenizer(model),
                         vocab_size=model.config.vocab_size, epochs=1)
    total = min(stream.batches_per_epoch, args.max_batches or stream.batches_per_epoch)
    log = get_logger(__name__)
    begin_stage(f"evaluating {total} batch(es)", say=False)  # the line below says it
    log.info("evaluating %d batch(es) of %d x %d tokens from %s (base %s)", total, args.batch, args.seq,
             stream.source, LoadOptions.from_args(args).describe())
    with progress_bar(total, description="eval", unit="batch", enabled=not args.quiet) as bar:
        result = text.held_out_loss(model, counted(itertools.islice(iter(stream), total), bar, log, total))
    log.info("held-out loss %.4f nats/token, perplexity %.3f over %d tokens (%s)", result.loss, result.perplexity,
             result.tokens, stream.source)
    print(json.dumps({"loss": result.loss, "perplexity": result.perplexity, "tokens": result.tokens,
                      "batches": result.batches}))
    return 0
