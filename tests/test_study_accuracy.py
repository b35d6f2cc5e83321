"""tools/study_accuracy.py: its statistics against hand-computed values, its verdict logic, and the
--quick smoke run end to end (table, JSON with every per-seed number, PNG, resume).

The hand computations use closed forms of Student's t for 2 and 3 degrees of freedom:
  df = 2: F(t) = 1/2 + t / (2 sqrt(t^2 + 2)), so the two-sided p = 1 - t / sqrt(t^2 + 2) and the
          q-quantile is (2q - 1) / sqrt(2 q (1 - q));
  df = 3: F(t) = 1/2 + (atan(t / sqrt 3) + (t / sqrt 3) / (1 + t^2 / 3)) / pi.
"""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load_tool():
    spec = importlib.util.spec_from_file_location("study_accuracy", REPO / "tools" / "study_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["study_accuracy"] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


study = _load_tool()


def test_paired_t_test_matches_the_hand_computation():
    # Differences 1, 2, 3: mean 2, sd 1, se 1/sqrt(3), t = 2 sqrt(3), df 2.
    result = study.paired_t_test([3.0, 4.0, 5.0], [2.0, 2.0, 2.0])
    t = 2 * math.sqrt(3)
    assert result.mean == pytest.approx(2.0)
    assert result.se == pytest.approx(1 / math.sqrt(3))
    assert result.t == pytest.approx(t) and result.df == 2 and result.n == 3
    assert result.p == pytest.approx(1 - t / math.sqrt(t * t + 2), rel=1e-9)  # 0.074180
    # 90% interval (the TOST interval at alpha 0.05): 2 -+ t_0.95,2 / sqrt(3), t_0.95,2 = 0.9 / sqrt(0.095).
    half = 0.9 / math.sqrt(0.095) / math.sqrt(3)
    assert (result.ci_low, result.ci_high) == (pytest.approx(2 - half), pytest.approx(2 + half))
    assert result.ci_level == pytest.approx(0.90)
    # The sign follows the order of the arms; a lone pair cannot be tested.
    assert study.paired_t_test([2.0, 2.0, 2.0], [3.0, 4.0, 5.0]).t == pytest.approx(-t)
    with pytest.raises(ValueError):
        study.paired_t_test([1.0], [2.0])


def test_paired_t_test_with_identical_differences_has_no_spread():
    result = study.paired_t_test([2.0, 3.0, 4.0], [1.0, 2.0, 3.0])
    assert result.mean == 1.0 and result.p == 0.0 and (result.ci_low, result.ci_high) == (1.0, 1.0)
    same = study.paired_t_test([1.0, 2.0], [1.0, 2.0])
    assert same.p == 1.0 and same.mean == 0.0


def test_corrected_kfold_t_test_inflates_the_variance_by_the_test_train_ratio():
    # J = 4 differences 1..4 (sd = sqrt(5/3)), n_test / n_train = 20 / 80: variance factor 1/4 + 1/4.
    result = study.corrected_kfold_t_test([1.0, 2.0, 3.0, 4.0], n_train=80, n_test=20)
    se = math.sqrt(0.5) * math.sqrt(5 / 3)
    t = 2.5 / se
    assert result.se == pytest.approx(se) and result.t == pytest.approx(t) and result.df == 3
    x = t / math.sqrt(3)
    cdf = 0.5 + (math.atan(x) + x / (1 + t * t / 3)) / math.pi
    assert result.p == pytest.approx(2 * (1 - cdf), rel=1e-9)  # 0.071422
    # The uncorrected test on the same numbers is the plain one-sample t (factor 1/J): smaller p.
    plain = study.paired_t_test([1.0, 2.0, 3.0, 4.0], [0.0] * 4)
    assert plain.se == pytest.approx(math.sqrt(5 / 3) / 2) and plain.p < result.p


def test_exact_wilcoxon_signed_rank():
    # n = 3, all positive: W+ = 6, and 2 of the 8 sign patterns are as extreme -> 0.25, the smallest
    # two-sided p three seeds can give.
    assert study.wilcoxon_signed_rank([0.5, 1.0, 2.0]) == (6.0, 0.25, 3)
    # n = 5, ranks 1..5, W+ = 13: P(W+ >= 13) + P(W+ <= 2) = 3/32 + 3/32.
    w_plus, p, n = study.wilcoxon_signed_rank([1.0, -2.0, 3.0, 4.0, 5.0])
    assert (w_plus, n) == (13.0, 5) and p == pytest.approx(6 / 32)
    # Zeros are dropped; tied |d| share the average rank (all three rank 2: W+ = 4, every pattern as
    # far from 3 as that) -> p = 1.
    assert study.wilcoxon_signed_rank([0.0, 0.5, 1.0, 2.0]) == (6.0, 0.25, 3)
    assert study.wilcoxon_signed_rank([1.0, 1.0, -1.0]) == (4.0, 1.0, 3)
    assert study.wilcoxon_signed_rank([0.0, 0.0]) == (0.0, 1.0, 0)


def test_mean_std_is_the_sample_standard_deviation():
    mean, std = study.mean_std([80.0, 82.0, 84.0])
    assert mean == pytest.approx(82.0) and std == pytest.approx(2.0)  # n - 1: sqrt(8 / 2)
    assert study.mean_std([5.0]) == (5.0, 0.0)


def test_equivalence_verdict_reads_the_interval_against_the_margin():
    assert study.equivalence_verdict(-1.0, 1.2, 1.5) == study.REPRODUCED
    assert study.equivalence_verdict(-0.5, 1.6, 1.5) == study.INCONCLUSIVE   # straddles +1.5
    assert study.equivalence_verdict(-1.5, 0.3, 1.5) == study.INCONCLUSIVE   # touches -1.5: not inside
    assert study.equivalence_verdict(1.5, 3.0, 1.5) == study.NOT_REPRODUCED  # entirely above +1.5
    assert study.equivalence_verdict(-3.0, -1.6, 1.5) == study.NOT_REPRODUCED


def test_superiority_verdict_needs_significance_and_the_claimed_sign():
    assert study.superiority_verdict(1.2, 0.01) == study.REPRODUCED
    assert study.superiority_verdict(-1.2, 0.01) == study.NOT_REPRODUCED
    assert study.superiority_verdict(1.2, 0.2) == study.INCONCLUSIVE
    assert study.superiority_verdict(1.2, 0.05) == study.INCONCLUSIVE  # p < alpha, strictly


def _record(settings, experiment, arm, seed, fold, correct, test_size=100, train_size=400):
    task = study.Task(experiment, arm, seed, fold)
    return (settings.fingerprint(experiment), task.key), {
        "key": task.key, "fingerprint": settings.fingerprint(experiment), "correct": correct,
        "test_size": test_size, "train_size": train_size, "accuracy": correct / test_size, "seconds": 1.0}


def test_claims_pool_folds_per_seed_and_test_the_fold_differences():
    settings = study.Settings(seeds=[0, 1, 2], folds=2)
    claim = next(c for c in study.CLAIMS if c.experiment == "scpl" and c.kind == "equivalent")
    correct = {"scpl": {0: (90, 92), 1: (91, 93), 2: (89, 95)}, "bp": {0: (90, 91), 1: (90, 92), 2: (90, 93)}}
    runs = dict(_record(settings, "scpl", arm, seed, fold, c[fold])
                for arm, by_seed in correct.items() for seed, c in by_seed.items() for fold in (0, 1))
    result = study.analyse_claim(claim, runs, settings)
    # Per seed: correct over both folds / 200 images, in points.
    assert result["per_seed"]["scpl"] == pytest.approx({0: 91.0, 1: 92.0, 2: 92.0})
    assert result["per_seed"]["bp"] == pytest.approx({0: 90.5, 1: 91.0, 2: 91.5})
    assert result["differences"] == pytest.approx([0.5, 1.0, 0.5])
    # The test runs over the 6 fold differences (points) with the k-fold correction 1/6 + 100/400.
    assert result["fold_differences"] == pytest.approx([0.0, 1.0, 1.0, 1.0, -1.0, 2.0])
    assert result["test"]["name"] == "corrected k-fold t" and result["test"]["n"] == 6
    expected = study.corrected_kfold_t_test([0.0, 1.0, 1.0, 1.0, -1.0, 2.0], 400, 100)
    assert result["test"]["p"] == pytest.approx(expected.p)
    assert result["verdict"] == study.equivalence_verdict(expected.ci_low, expected.ci_high, 1.5)
    # A seed with a fold missing is left out; fewer than two seeds is "incomplete", not a verdict.
    del runs[(settings.fingerprint("scpl"), study.Task("scpl", "bp", 2, 1).key)]
    assert study.analyse_claim(claim, runs, settings)["seeds"] == [0, 1]
    for seed in (0, 1):
        del runs[(settings.fingerprint("scpl"), study.Task("scpl", "bp", seed, 0).key)]
    assert study.analyse_claim(claim, runs, settings)["verdict"] == study.INCOMPLETE


def test_fingerprint_separates_settings_but_not_seeds():
    base = study.Settings()
    assert base.fingerprint("segprop") == study.Settings(seeds=[0, 1, 2, 3, 4]).fingerprint("segprop")
    assert base.fingerprint("segprop") == study.Settings(fgd_lr=1e-2).fingerprint("segprop")
    assert base.fingerprint("asyncfgd") != study.Settings(fgd_lr=1e-2).fingerprint("asyncfgd")
    changed = study.Settings(epochs={**base.epochs, "segprop": 2})
    assert base.fingerprint("segprop") != changed.fingerprint("segprop")
    assert base.fingerprint("scpl") == changed.fingerprint("scpl")


def test_quick_study_writes_the_table_json_and_png(tmp_path, capsys):
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    from edgetrain.data import FASHION_MNIST_DIR

    experiments = ["segprop", "scpl", "asyncfgd", "subnet"] if FASHION_MNIST_DIR.is_dir() else ["scpl", "subnet"]
    out = tmp_path / "study"
    payload = study.main(["--quick", "--claims", ",".join(experiments), "--out", str(out)])
    claims = [c for c in study.CLAIMS if c.experiment in experiments]
    saved = json.loads((out / "study.json").read_text())
    assert [r["claim"] for r in saved["claims"]] == [c.name for c in claims]
    settings = study.quick_settings()
    runs = saved["runs"]
    assert len(runs) == len(study.tasks_for(settings, experiments))
    for result in saved["claims"]:
        assert result["verdict"] in (study.REPRODUCED, study.NOT_REPRODUCED, study.INCONCLUSIVE)
        assert result["seeds"] == settings.seeds
        for arm in result["arms"]:  # every per-seed number, in points, and its accuracy in runs
            per_seed = result["per_seed"][arm]
            assert len(per_seed) == len(settings.seeds)
            assert all(0.0 <= v <= 100.0 for v in per_seed.values())
    table = (out / "table.md").read_text()
    assert table.count("\n") == len(claims) + 2 and all(c.name in table for c in claims)
    assert (out / "study.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert payload["claims"][0]["claim"] == claims[0].name
    # A second call finds every run in runs.jsonl and trains nothing.
    capsys.readouterr()
    again = study.main(["--quick", "--claims", ",".join(experiments), "--out", str(out)])
    assert f"{len(runs)} of {len(runs)} runs already" in capsys.readouterr().out
    assert [r["verdict"] for r in again["claims"]] == [r["verdict"] for r in saved["claims"]]
