"""The peak resident set of one `edgetrain` command as a user runs it, above the floor of the same
interpreter with torch and edgetrain imported.

Each run is a fresh process that imports torch and edgetrain, runs the command through edgetrain.cli.main
(or, for the floor, nothing) and writes its own peak resident set (getrusage's ru_maxrss: what the OS
charged it at most, file-backed pages of a memory-mapped model included) to a JSON file. Reading it in the
child, not through RUSAGE_CHILDREN in the parent, keeps each figure that one process's; the child also keeps
the high-water marks edgetrain's probe restarts between steps (see _CHILD).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from edgetrain.registry import EdgetrainError

# Runs in the child: argv[1] the JSON file to write, argv[2:] the command (none: the floor). edgetrain's own
# Linux probe restarts the kernel's high-water mark (VmHWM, which ru_maxrss follows) before each step it
# measures, so the child keeps the highest mark seen before every restart; elsewhere ru_maxrss is the peak.
_CHILD = """
import importlib, json, os, resource, sys
import torch, edgetrain, edgetrain.cli, edgetrain.training.learner
for module in filter(None, os.environ.get("EDGETRAIN_PEAK_IMPORTS", "").split(",")):
    importlib.import_module(module)
from edgetrain.probes import linux
highest = [0]
def high_water():
    try:
        return linux._read_kb_field(linux.Path("/proc/self/status"), "VmHWM") or 0
    except OSError:
        return 0
restart = linux.LinuxProbe.reset_peak
def keep_then_restart(self):
    highest[0] = max(highest[0], high_water())
    restart(self)
linux.LinuxProbe.reset_peak = keep_then_restart
code = edgetrain.cli.main(sys.argv[2:]) if len(sys.argv) > 2 else 0
maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
json.dump({"peak_rss_bytes": max(highest[0], high_water(), maxrss), "exit_code": code}, open(sys.argv[1], "w"))
"""


def peak_rss_of_command(command: Sequence[str], *, imports: Sequence[str] = (), cwd: str | Path | None = None,
                        timeout: float = 1800) -> int:
    """The peak resident set, in bytes, of a fresh interpreter with torch and edgetrain (and `imports`)
    imported running `edgetrain <command>` (an empty command: the floor). A command that fails raises
    EdgetrainError with the end of its stderr."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "peak.json"
        done = subprocess.run([sys.executable, "-c", _CHILD, str(out), *command], cwd=cwd, capture_output=True,
                              text=True, timeout=timeout,
                              env={**os.environ, "EDGETRAIN_PEAK_IMPORTS": ",".join(imports)})
        if done.returncode != 0 or not out.exists():
            raise EdgetrainError(f"edgetrain {' '.join(command)} exited {done.returncode}: {done.stderr[-2000:]}")
        result = json.loads(out.read_text())
    if result["exit_code"] != 0:
        raise EdgetrainError(f"edgetrain {' '.join(command)} returned {result['exit_code']}")
    return int(result["peak_rss_bytes"])
