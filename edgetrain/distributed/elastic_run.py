"""torchrun, with its failures written down as data: `python -m edgetrain.distributed.elastic_run FAILURES.json
<torchrun arguments>` runs exactly what `torchrun <torchrun arguments>` runs (torch.distributed.run's own
argument parser and launch), and when workers fail it writes torch.distributed.elastic's record of each
failed rank -- exit code, signal, error file, message, time -- to FAILURES.json before exiting 1.

edgetrain.distributed.launch decides whether to run a job again from that record, not from torchrun's text.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

FAILURE_EXIT_CODE = 1


def failure_record(error: Any) -> dict[str, Any]:
    """A ChildFailedError as JSON: every failed rank, and which one failed first (the root cause; the
    others are usually the launcher's SIGTERMs that followed it)."""
    first_rank, _ = error.get_first_failure()
    failures = {}
    for rank, failure in error.failures.items():
        failures[str(rank)] = {"local_rank": failure.local_rank, "pid": failure.pid, "exitcode": failure.exitcode,
                               "signal": failure.signal_name() if failure.exitcode < 0 else None,
                               "error_file": failure.error_file or None, "message": failure.message,
                               "timestamp": failure.timestamp}
    return {"name": error.name, "first_rank": first_rank, "failures": failures}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m edgetrain.distributed.elastic_run FAILURES.json <torchrun arguments>", file=sys.stderr)
        return 2
    failures_path, torchrun_argv = Path(argv[0]), argv[1:]
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(torchrun_argv))
    except ChildFailedError as error:
        from edgetrain.training.checkpoint import atomic_write_bytes

        atomic_write_bytes(json.dumps(failure_record(error), indent=1).encode(), failures_path)
        print(error.format_msg(), file=sys.stderr)  # the summary torchrun itself prints, for people
        return FAILURE_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
