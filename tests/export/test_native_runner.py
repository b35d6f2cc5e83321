"""The native C++ runner (targets/executorch/runner.cpp) built by the top-level CMakeLists.txt trains an
exported .pte with the same loss trajectory and weights as the ExecuTorch Python runtime and torch."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    pytest.importorskip("executorch.extension.training", reason="ExecuTorch not installed: pip install 'edgetrain[export]'")
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        pytest.skip("building the native runner needs cmake and a C++ compiler")
    from edgetrain.export.native import build_runner

    return build_runner(tmp_path_factory.mktemp("native-build"))


def test_runner_loss_trajectory_equals_the_python_runtime(runner, tmp_path):
    pytest.importorskip("sklearn", reason="the digits stream needs scikit-learn")
    import itertools

    import edgetrain
    from edgetrain.data import digits_stream
    from edgetrain.export import export_training, load_trainer, make_trainable, write_batch_file
    from edgetrain.export.native import run_runner

    model = make_trainable(edgetrain.load_model("mlp-digits"), "head")
    batches = list(itertools.islice(digits_stream(batch_size=16), 12))
    program = export_training(model, batches[0], "executorch", tmp_path / "head.pte")
    batch_file = write_batch_file(tmp_path / "batches.bin", batches)
    native = run_runner(runner, program, batch_file, 0.3, save=tmp_path / "trained.safetensors")
    trainer = load_trainer("executorch", program, 0.3, batches[0])
    python_losses = [trainer.step(batch) for batch in batches]
    assert len(native.losses) == len(batches)
    assert native.losses[0] == python_losses[0]  # same program, same batch, same weights: bit for bit
    assert native.losses == pytest.approx(python_losses, abs=1e-6, rel=0)
    weights = trainer.parameters()
    assert set(native.parameters) == set(weights) == {"head.weight", "head.bias"}
    for name, value in weights.items():
        assert float((native.parameters[name] - value).abs().max()) <= 1e-6
    assert float((native.parameters["head.weight"] - model.head.weight).abs().max()) > 1e-3  # it trained
    # --steps stops early; a batch file of the wrong shape is refused (exit status 3) with the shapes in question.
    assert len(run_runner(runner, program, batch_file, 0.3, steps=2).losses) == 2
    from edgetrain.export import ExportError

    wrong = write_batch_file(tmp_path / "wrong.bin", list(itertools.islice(digits_stream(batch_size=8), 2)))
    with pytest.raises(ExportError, match=r"exited with 3 .*wrong.bin: the batches are Float \[8, 64\], Long \[8\], "
                                          r".*head.pte takes Float \[16, 64\], Long \[16\]"):
        run_runner(runner, program, wrong, 0.3)


@pytest.mark.slow  # tools/test runs it through ctest (CMakeLists.txt) already
def test_export_head_cpp_sample_quick(runner, tmp_path):
    pytest.importorskip("sklearn", reason="the digits stream needs scikit-learn")
    result = subprocess.run([sys.executable, str(REPO / "samples" / "export_head_cpp.py"), "--quick",
                             "--runner", str(runner), "--workdir", str(tmp_path / "work")],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["steps"] == 40
    assert max(v for k, v in report.items() if k.startswith("max_")) <= 1e-5
    assert "held-out accuracy" in result.stdout
