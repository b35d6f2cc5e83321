"""The long fuzz run: the hypothesis tests of tests/reliability drawing three times as many hostile files,
adapters, values and batches as the default run. Slow (CI's slow lane); the counts print as usual."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fault_tally import FUZZ_SCALE_VARIABLE

FUZZ_FILES = ["test_fuzz_loaders.py", "test_hostile_adapters.py", "test_hostile_values.py"]


@pytest.mark.slow
def test_three_times_the_hostile_examples_are_all_refused_or_accepted_soundly():
    here = Path(__file__).parent
    env = dict(os.environ, **{FUZZ_SCALE_VARIABLE: "3"})
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                           *[str(here / name) for name in FUZZ_FILES]],
                          cwd=here.parent.parent, env=env, capture_output=True, text=True, timeout=3600)
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " 0 unhandled or silently wrong" in done.stdout
