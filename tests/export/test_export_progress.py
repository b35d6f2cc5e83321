"""`edgetrain export --method mesp` is never ten seconds without a line (docs/export.md): lowering SmolLM2's program
to XNNPACK takes minutes inside ExecuTorch's calls, so it says which method it lowers, and a heartbeat says how
long it has been and what is left. Lowering one method at a time writes the bytes one call for all of them wrote."""
from __future__ import annotations

import re
import sys

import pytest
import torch

pytest.importorskip("executorch.exir", reason="ExecuTorch not installed: pip install 'edgetrain[export]'")

from progress_testkit import FakeClock, StampedStream, longest_silence  # noqa: E402

from edgetrain.cli import main as cli_main  # noqa: E402
from edgetrain.export import executorch as lowering  # noqa: E402
from edgetrain.utils import progress  # noqa: E402

# The slowed lowering's pace: a step of STEP_SECONDS (fake time) for every NODES_A_STEP graph nodes of a method.
STEP_SECONDS, NODES_A_STEP = 6, 100
ARGV = ["export", "--method", "mesp", "--model", "tiny", "--seq", "16", "--batch", "2", "--rank", "2"]


@pytest.fixture
def slowed_lowering(monkeypatch):
    """The lowering as slow as a real model's, on a fake clock: each method STEP_SECONDS for every NODES_A_STEP
    graph nodes (to the second: a pace for the estimate to find), writing the program two steps. The traced graphs
    are real; ExecuTorch's lowering is skipped (the program's bytes are not what is measured here)."""
    clock = FakeClock()
    monkeypatch.setattr(progress, "time", clock)
    monkeypatch.setattr(progress, "HEARTBEAT_TICK_S", 0.001)

    def lower(name, exported, partitioners):
        clock.pass_seconds(round(lowering._operator_count(exported) * STEP_SECONDS / NODES_A_STEP))
        return exported

    class Program:
        buffer = b"a program"
        executorch_program = type("Plans", (), {"execution_plan": []})()

    def write(lowered):
        clock.pass_seconds(2 * STEP_SECONDS)
        return Program()

    monkeypatch.setattr(lowering, "_lower_method", lower)
    monkeypatch.setattr(lowering, "_executorch_program", write)
    return clock


def _run(argv: list[str], clock: FakeClock, monkeypatch) -> tuple[StampedStream, StampedStream, float, float]:
    out, err = StampedStream(clock), StampedStream(clock)
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    start = clock.monotonic()
    assert cli_main(argv) == 0
    return out, err, start, clock.monotonic()


def test_export_mesp_is_never_ten_seconds_without_a_line_and_estimates_what_is_left(
        slowed_lowering, tmp_path, monkeypatch, edgetrain_logger_as_found):
    out, err, start, end = _run([*ARGV, "--out", str(tmp_path / "tiny.pte")], slowed_lowering, monkeypatch)
    lines = [line for _, line in err.lines]
    assert end - start > 60, "the slowed lowering was not slow"
    timeline = "\n".join(f"{when - start:6.1f} {line}" for when, line in sorted(out.lines + err.lines))
    assert longest_silence(start, end, out, err) <= 10, timeline
    for number, method in enumerate(("embed", "block_forward", "block_backward", "head", "adamw"), 1):
        assert any(re.search(rf"lowering to XNNPACK: {method} \({number} of 5\): [\d,]+ graph nodes?$", line)
                   for line in lines), method
    assert any(line.endswith("lowering to XNNPACK: writing the program") for line in lines)
    assert any(line.startswith("wrote ") for _, line in out.lines)

    # The slowed lowering keeps one pace, so the estimate (the pace of the methods lowered so far times the nodes
    # left, less what the running method has had) should be what was left, give or take the rounding of each
    # method's time to whole seconds.
    lowered = next(when for when, line in err.lines if line.endswith("writing the program"))
    estimates = [(when, _seconds(match.group(1))) for when, line in err.lines
                 if (match := re.search(r"graph nodes done, about (\d+ s|\d+:\d\d) left$", line))]
    assert estimates
    for when, estimate in estimates:
        assert abs(estimate - (lowered - when)) <= 2 + 0.1 * (lowered - when), (estimate, lowered - when)


def _seconds(text: str) -> int:
    if text.endswith(" s"):
        return int(text[:-2])
    minutes, seconds = text.split(":")
    return 60 * int(minutes) + int(seconds)


def test_quiet_prints_no_progress(slowed_lowering, tmp_path, monkeypatch, edgetrain_logger_as_found):
    out, err, _, _ = _run([*ARGV, "--out", str(tmp_path / "tiny.pte"), "--quiet"], slowed_lowering, monkeypatch)
    assert err.lines == []
    assert [line for _, line in out.lines if line.startswith("wrote ")]


class _Scaled(torch.nn.Module):
    def forward(self, x, weight):
        return torch.nn.functional.linear(x, weight).exp() * 1.5


class _Tiles(torch.nn.Module):
    def forward(self, x, table):
        total = torch.zeros(x.shape[0], table.shape[1])
        for start in range(0, table.shape[0], 32):
            tile = table[start:start + 32] * 1.5
            total = total + torch.mm(torch.mm(x, tile.t()).exp(), tile)
        return total


@pytest.mark.parametrize("delegate", ["xnnpack", "none"])
def test_lowering_method_by_method_writes_the_bytes_one_call_wrote(delegate):
    # What lower_methods did before it lowered one method at a time, for progress to name the method.
    pytest.importorskip("executorch.backends.xnnpack")
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    modules = {"scaled": _Scaled(), "tiles": _Tiles()}
    examples = {"scaled": (torch.randn(8, 16), torch.randn(24, 16)), "tiles": (torch.randn(8, 16), torch.randn(96, 16))}
    exported = {name: lowering.trace_for_lowering(module, examples[name], delegate) for name, module in modules.items()}
    config = EdgeCompileConfig(_core_aten_ops_exception_list=[torch.ops.aten.linear.default],
                               preserve_ops=[torch.ops.aten.linear.default])
    partitioners = {name: lowering.DELEGATES.get(delegate).partitioners() for name in modules}
    edge = to_edge_transform_and_lower(exported, partitioner=partitioners, compile_config=config)
    for name in modules:
        lowering._restore_traced_order(edge.exported_program(name).graph_module)
    assert lowering.lower_methods(modules, examples, delegate) == edge.to_executorch().buffer
