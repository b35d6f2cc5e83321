#!/usr/bin/env python3
"""The peak resident set of what a user runs on a GGUF model, with default flags and with --dequantize,
side by side in one run: `edgetrain train --method mesp`, `edgetrain eval`, `edgetrain personalise run`.

Each figure is a fresh process (edgetrain.profiler.command_peak) over the same text (Python's own
documentation, pydoc_data.topics), measured above two floors taken in the same rounds:
  import floor    the interpreter with torch and edgetrain imported, nothing run
  runtime floor   that plus torch._dynamo (about 70 MiB), which torch.optim and torch.utils.checkpoint import
                  on first use and edgetrain's own optimizers do not (what `edgetrain profile` counts as
                  torch's runtime)

  .venv/bin/python tools/user_path_peaks.py                    # SmolLM2-135M's GGUF, one round
  .venv/bin/python tools/user_path_peaks.py --repeats 3        # median and spread of three
(tools/bench_quantized.py runs it after its own arms.)
"""
from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from edgetrain.profiler.bench import Arm, measure_interleaved, summarise
from edgetrain.profiler.command_peak import peak_rss_of_command

MIB = 2**20
IMPORT_FLOOR, RUNTIME_FLOOR = "import floor", "runtime floor"
FLAGS = {"default": [], "--dequantize": ["--dequantize"]}


def write_text(directory: Path) -> Path:
    from pydoc_data.topics import topics

    path = directory / "docs.txt"
    path.write_text("\n\n".join(topics[key] for key in sorted(topics)), encoding="utf-8")
    return path


def fresh_store(directory: Path, text: Path, count: int = 40) -> Path:
    """A new store holding `count` notes cut from `text` (added in this process: adding loads no model)."""
    from edgetrain.cli import main

    store = Path(tempfile.mkdtemp(dir=directory, prefix="store-"))
    words = text.read_text(encoding="utf-8").split()
    notes = []
    for index in range(count):
        note = directory / f"note-{index}.txt"
        note.write_text(" ".join(words[index * 120:(index + 1) * 120]), encoding="utf-8")
        notes.append(str(note))
    with contextlib.redirect_stdout(io.StringIO()):  # the ids it prints are not the benchmark's
        if main(["personalise", "add", "--store", str(store), "--quiet", *notes]) != 0:
            raise SystemExit("could not add the notes to a store")
    return store


def commands(model: str, text: Path, directory: Path) -> dict[str, callable]:
    """Path name -> a function giving the command line (a personalise run gets a fresh store each time)."""
    return {
        "train --method mesp": lambda: ["train", "--model", model, "--method", "mesp", "--files", str(text),
                                        "--steps", "4", "--quiet"],
        "eval": lambda: ["eval", "--model", model, "--data", str(text), "--max-batches", "4", "--quiet"],
        "personalise run": lambda: ["personalise", "run", "--store", str(fresh_store(directory, text)), "--model",
                                    model, "--max-steps", "4", "--window-steps", "4", "--quiet"],
    }


def print_user_path_peaks(model: str, repeats: int = 1) -> dict[str, dict]:
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        text = write_text(directory)
        arms = [Arm(IMPORT_FLOOR, lambda: {"peak": peak_rss_of_command([])}),
                Arm(RUNTIME_FLOOR, lambda: {"peak": peak_rss_of_command([], imports=["torch._dynamo"])})]
        for path, command in commands(model, text, directory).items():
            for label, flags in FLAGS.items():
                arms.append(Arm(f"{path} ({label})", lambda command=command, flags=flags:
                                {"peak": peak_rss_of_command([*command(), *flags])}))
        samples = measure_interleaved(arms, repeats=repeats, warmup=0, description="user paths")
    summaries = {name: summarise(taken)["peak"] for name, taken in samples.items()}
    floor, runtime = summaries[IMPORT_FLOOR].median, summaries[RUNTIME_FLOOR].median
    print(f"\n{model}: peak resident set of each command, MiB above the import floor ({floor / MIB:.0f} MiB: "
          f"torch and edgetrain imported) and above the runtime floor (+ torch._dynamo: {(runtime - floor) / MIB:.0f} "
          f"MiB more); median of {repeats}, spread = (high - low) / median")
    print(f"{'command':<34}{'default':>10}{'--dequantize':>14}{'default/deq':>13}{'above runtime':>15}{'spread':>8}")
    for path in commands(model, Path(), Path()):
        packed, dense = summaries[f"{path} (default)"], summaries[f"{path} (--dequantize)"]
        print(f"{path:<34}{(packed.median - floor) / MIB:>10.0f}{(dense.median - floor) / MIB:>14.0f}"
              f"{(packed.median - floor) / (dense.median - floor):>12.2f}x"
              f"{(packed.median - runtime) / MIB:>15.0f}{packed.spread:>8.2f}")
    return summaries


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a GGUF model (path or pretrained name)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every arm (alternating order)")
    args = parser.parse_args(argv)
    print_user_path_peaks(args.model, repeats=args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
