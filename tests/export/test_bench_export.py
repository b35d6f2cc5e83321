"""tools/bench_export.py runs its arms side by side and prints the ratios issue 35 asks for (a smoke run on
`tiny`, slow lane; the SmolLM2 figures are in docs/export.md)."""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # three exports, two with XNNPACK: about 7 minutes
REPO = Path(__file__).resolve().parents[2]
pytest.importorskip("executorch.exir", reason="ExecuTorch not installed: pip install 'edgetrain[export]'")


def test_bench_export_smoke(tmp_path, capsys):
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        pytest.skip("building the native runners needs cmake and a C++ compiler")
    spec = importlib.util.spec_from_file_location("bench_export", REPO / "tools" / "bench_export.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "figures.json"
    work = tmp_path / "exports"
    flags = ["--model", "tiny", "--seq", "16", "--steps", "2", "--skip-joint", "--build", str(tmp_path / "build"),
             "--work", str(work)]
    assert bench.main([*flags, "--repeats", "2", "--json", str(out)]) == 0
    # --work keeps the exports: the same flags measure again without exporting, other flags are refused.
    import edgetrain.export.mesp_program as mesp_program

    exported = mesp_program.export_mesp_program
    mesp_program.export_mesp_program = lambda *a, **k: pytest.fail("exported again")
    try:
        again = tmp_path / "again.json"
        assert bench.main([*flags, "--repeats", "1", "--json", str(again)]) == 0
        assert json.loads(again.read_text())["rows"]["runner, packed"]["step_s"] > 0
        with pytest.raises(SystemExit):
            bench.main([*flags[:3], "32", *flags[4:]])
    finally:
        mesp_program.export_mesp_program = exported
    figures = json.loads(out.read_text())
    assert set(figures["rows"]) == {"torch mesp", "runner, packed", "packed, no XNNPACK", "runner, fp32"}
    for row in figures["rows"].values():
        assert row["peak_mib"] > 0 and row["step_s"] > 0
    assert all(value > 0 for value in figures["ratios"].values())
    assert len(figures["rows"]["runner, packed"]["runs"]) == 2 and len(figures["paired_step_ratios"]) == 2
    printed = capsys.readouterr().out
    assert "packed runner step / torch mesp step" in printed and "torch mesp (run 2)" in printed
