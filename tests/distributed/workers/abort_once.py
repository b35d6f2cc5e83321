"""A torchrun worker for tests/distributed/test_launch.py. argv: OUT MARKER [python-error].

The first run (MARKER absent) creates MARKER and rank 1 dies of SIGABRT -- what a C++ abort in the
transport looks like: no Python traceback. With "python-error" rank 1 raises instead, and rank 0 waits
until the launcher stops it. Later runs meet at
a barrier and rank 0 writes {"world_size"} to OUT."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist


def main() -> int:
    out, marker = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    python_error = sys.argv[3:] == ["python-error"]
    if python_error and dist.get_rank() == 0:
        # Wait for rank 1's own error rather than race it: at the barrier, rank 0 would fail as soon as rank
        # 1 closed its connection, and the launcher could then stop rank 1 (SIGTERM) before its exit code 1.
        time.sleep(90)
    try:
        if dist.get_rank() == 1 and not marker.exists():
            marker.write_text("the first run died here")
            if python_error:
                raise ValueError("a bug of the worker's own")
            os.abort()
        dist.barrier()
        if dist.get_rank() == 0:
            out.write_text(json.dumps({"world_size": dist.get_world_size()}))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
