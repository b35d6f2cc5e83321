"""samples/mesp_app_cpp.py with the program an app ships (XNNPACK): the native runner trains the user's own
token stream to the Python replay's adapters bit for bit and torch's mesp's (losses within 1e-5, adapters
within 1% of what training moved them), and the adapter lowers the held-out loss. Slow lane: lowering tiny to XNNPACK takes about 4 minutes on 2 cores. ctest runs the same
sample on ExecuTorch's own kernels (--delegate none), which lower in seconds."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("executorch.exir", reason="ExecuTorch not installed: pip install 'edgetrain[export]'")

from edgetrain.export.native import MESP_RUNNER, build_runner  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_xnnpack_program_trains_in_the_runner_as_the_replay_and_torch(tmp_path):
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        pytest.skip("building the native runner needs cmake and a C++ compiler")
    runner = build_runner(tmp_path / "native-build", target=MESP_RUNNER)
    done = subprocess.run([sys.executable, str(REPO / "samples" / "mesp_app_cpp.py"), "--quick", "--runner",
                           str(runner), "--workdir", str(tmp_path / "work")],
                          capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["steps"] == 6 and report["bit_equal_to_python_replay"] is True
    assert report["max_loss_diff_vs_torch"] <= 1e-5 and report["max_adapter_diff_vs_torch_of_change"] <= 1e-2
    assert report["held_out_after"] < report["held_out_before"]
