"""A program the crash tests start and kill -9 at a random moment.

    python crash_child.py add STORE FIRST      # adds notes FIRST, FIRST+1, ...; prints each id once add returned
    python crash_child.py run STORE            # trains the store; prints each event as a JSON line
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    mode, store = sys.argv[1], sys.argv[2]
    if mode == "add":
        from edgetrain.personalise import Store

        first = int(sys.argv[3])
        with Store(store) as examples:
            for number in range(first, first + 100_000):
                example_id = examples.add(f"note {number}: the user wrote this down at step {number}")
                print(example_id, flush=True)
    else:
        import torch

        from personalise_kit import make

        torch.set_num_threads(1)

        def report(event: dict) -> None:
            print(json.dumps(event), flush=True)

        make(store, on_event=report).run(max_steps=10**6)


if __name__ == "__main__":
    main()
