"""tools/bench_personalise.py end to end on a tiny GGUF (tests/gguf_testkit.py) instead of SmolLM2-135M:
every arm in its own worker process, the table, the ratios to mebp and to PEFT, the JSON and the PNG, and
that the arms really trained -- the exact-gradient arms of both libraries on one trajectory, mesp lowering
the held-out perplexity."""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("matplotlib")
from gguf_testkit import hf_model, write_gguf  # noqa: E402

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_personalise.py"
EXACT = ("bp", "mebp", "mesp", "peft", "peft+gc")  # exact gradients, same start, same batches


def _tool():
    """The tool as a module (tools/ is not a package); registered first, as its dataclasses need."""
    if "bench_personalise" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_personalise", TOOL)
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_personalise"] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_personalise"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One quick run of every arm; (printed output, the JSON, the PNG path)."""
    import contextlib
    import io

    tmp = tmp_path_factory.mktemp("personalise")
    model = write_gguf(tmp / "tiny.gguf", hf_model())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = _tool().main(["--model", str(model), "--steps", "3", "--seq", "32", "--batch", "2",
                             "--eval-tokens", "256", "--eval-every", "3", "--lr", "1e-2",
                             "--json", str(tmp / "run.json"), "--png", str(tmp / "run.png")])
    assert code == 0
    return out.getvalue(), json.loads((tmp / "run.json").read_text()), tmp / "run.png"


def test_the_table_has_every_arm_with_its_ratios_to_mebp_and_to_peft(run):
    printed, record, png = run
    tool = _tool()
    lines = printed.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("arm "))
    end = next(i for i, line in enumerate(lines) if line.startswith("(in brackets: ratio to mebp and to peft)"))
    rows = [line.split()[0] for line in lines[header + 1:end]]
    assert rows == list(tool.ARMS)
    assert set(record["summaries"]) == set(tool.ARMS)
    medians = {arm: {m: s["median"] for m, s in by.items()} for arm, by in record["summaries"].items()}
    for baseline in ("mebp", "peft"):
        ratios = record["context"]["ratios_to"][baseline]
        for arm in tool.ARMS:
            for metric in ("step_seconds", "step_peak_os_bytes", "tensor_peak_bytes", "process_peak_os_bytes",
                           "ppl_after"):
                value = medians[arm][metric]
                assert value is not None and math.isfinite(value) and value > 0, (arm, metric)
                assert ratios[arm][metric] == pytest.approx(value / medians[baseline][metric]), (arm, baseline)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_arms_trained_from_one_start_along_one_trajectory(run):
    _, record, _ = run
    summaries = record["context"]
    before = {arm: summaries["before"][arm]["held_out_ppl"] for arm in summaries["before"]}
    after = {arm: record["summaries"][arm]["ppl_after"]["median"] for arm in record["summaries"]}
    # One GGUF and one initial adapter (B = 0): every arm, edgetrain or transformers, starts at the base model.
    assert max(before.values()) / min(before.values()) - 1 < 1e-4
    assert after["mesp"] < 0.9 * before["mesp"]
    # Exact gradients of the same loss from the same adapter on the same batches: the same weights after.
    for arm in EXACT:
        assert after[arm] == pytest.approx(after["mesp"], rel=1e-3), arm
    # mezo's curve has its evaluations too, at steps 0 and 3 (the last).
    assert [step for step, _ in summaries["curves"]["mezo"]] == [0, 3]
