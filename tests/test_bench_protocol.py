"""edgetrain.profiler.bench, the protocol of every benchmark: interleaved rounds, warm-up discarded,
medians and spreads, ratios to a named baseline, and the table, JSON and PNG they are reported in."""
from __future__ import annotations

import json

import pytest

from edgetrain.profiler.bench import (Arm, Column, format_table, measure_interleaved, ratios, round_orders,
                                      summarise, write_json, write_png)
from edgetrain.registry import EdgetrainError


def test_rounds_alternate_their_order():
    assert round_orders(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]


def _drifting_arms(names, calls, cost=None):
    """Arms whose measured time is the machine's slowness at the moment they run: it grows by one each call
    (a machine heating up), times the arm's own cost."""
    cost = cost or {}

    def make(name):
        def run():
            calls.append(name)
            return {"seconds": float(len(calls)) * cost.get(name, 1.0), "bytes": None}
        return Arm(name, run)
    return [make(name) for name in names]


def test_warm_up_runs_are_discarded_and_rounds_interleave():
    calls: list[str] = []
    samples = measure_interleaved(_drifting_arms("abc", calls), repeats=2, warmup=1, progress=False)
    assert calls == list("abc") + list("abc") + list("cba")
    assert [s["seconds"] for s in samples["a"]] == [4.0, 9.0]  # the warm-up call (1.0) is not a sample
    assert all(len(taken) == 2 for taken in samples.values())


def test_drift_hits_every_arm_alike():
    calls: list[str] = []
    samples = measure_interleaved(_drifting_arms("abc", calls), repeats=4, warmup=0, progress=False)
    summaries = {arm: summarise(taken) for arm, taken in samples.items()}
    # Same cost, a machine slowing steadily: every arm's median equals the baseline's.
    assert {arm: r["seconds"] for arm, r in ratios(summaries, "a").items()} == {"a": 1.0, "b": 1.0, "c": 1.0}


def test_a_twice_as_costly_arm_is_two_times_the_baseline():
    calls: list[str] = []
    samples = measure_interleaved(_drifting_arms("ab", calls, cost={"b": 2.0}), repeats=2, warmup=0,
                                  progress=False)
    summaries = {arm: summarise(taken) for arm, taken in samples.items()}
    assert ratios(summaries, "a")["b"]["seconds"] == pytest.approx(2.0)
    table = format_table("t", summaries, "a", [Column("seconds", "time", unit="s"), Column("bytes", "memory")])
    lines = table.splitlines()
    assert "(1.00x)" in lines[2] and "(2.00x)" in lines[3] and lines[2].rstrip().endswith("-")


def test_summaries_take_the_median_and_range_of_what_was_measured():
    summary = summarise([{"t": 3.0, "m": None}, {"t": 1.0, "m": 5.0}, {"t": 2.0, "m": 7.0}])
    assert (summary["t"].median, summary["t"].low, summary["t"].high, summary["t"].count) == (2.0, 1.0, 3.0, 3)
    assert summary["t"].spread == 1.0 and summary["m"].median == 6.0 and summary["m"].count == 2


@pytest.mark.parametrize("kwargs, message", [({"repeats": 0}, "repeats must be >= 1"),
                                              ({"warmup": -1}, "warmup >= 0")])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(EdgetrainError, match=message):
        measure_interleaved([Arm("a", lambda: {})], progress=False, **kwargs)


def test_arm_names_must_differ_and_the_baseline_must_be_one():
    with pytest.raises(EdgetrainError, match="must differ"):
        measure_interleaved([Arm("a", lambda: {}), Arm("a", lambda: {})], progress=False)
    with pytest.raises(EdgetrainError, match="baseline 'z'"):
        ratios({"a": summarise([{"t": 1.0}])}, "z")


def test_json_and_png_reports(tmp_path):
    samples = {"a": [{"t": 1.0}, {"t": 1.2}], "b": [{"t": 2.0}, {"t": 2.2}]}
    summaries = {arm: summarise(taken) for arm, taken in samples.items()}
    written = json.loads(write_json(tmp_path / "r.json", summaries, "a", samples, machine="test").read_text())
    assert written["ratios"]["b"]["t"] == pytest.approx(2.1 / 1.1)
    assert written["samples"]["a"] == samples["a"] and written["context"] == {"machine": "test"}
    assert written["summaries"]["b"]["t"]["median"] == pytest.approx(2.1)
    pytest.importorskip("matplotlib")
    png = write_png(tmp_path / "r.png", summaries, "a", Column("t", "time"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
