#!/usr/bin/env python3
"""Accuracy study (issue 22): each paper's accuracy claim as a paired comparison over seeds.

Every claim compares two arms trained on the same data, with the same model, epochs, batch order and
seeds; only the training method differs. Per seed the study records each arm's test accuracy, then
reports mean ± std, the paired difference with its confidence interval, a paired t-test, an exact
Wilcoxon signed-rank test, and a verdict: reproduced / not reproduced / inconclusive.

Experiments (--claims picks them; each trains its arms once and feeds one or two claims):

  segprop   Fashion-MNIST 60,000 / 10,000 (Debian dataset-fashion-mnist). A ResNet of the paper's shape
            scaled down: CIFAR stem, one BasicBlock per stage, widths 8/16/32, the paper's MLP classifier
            (GAP, Linear 32-32, ReLU, dropout 0.3, Linear 32-10; appendix B.2). AdamW with weight decay
            0.01 (appendix B.1) at lr 1e-3 and batch 64: the paper's 3e-4 at batch 256 is tuned for 400
            epochs per stage, and at one epoch per stage it left every arm far from converged (pilot,
            seed 0: bp 78.3%, segprop 63.9%, lw 50.3%). segprop: the `resnet-paper` view, GH = the last
            conv + BN + the MLP, 3 segments; lw: the same segments with GAP + Linear auxiliary
            classifiers and a final head stage (appendix B.2.3). Each stage trains `epochs` epochs (the
            paper's protocol: epochs per stage); bp trains 3 x `epochs`, the passes of SegProp's whole
            schedule (the paper gives e2e as many epochs as one stage, but its e2e had converged).
            Claims: segprop within 1.5 points of bp (Fig. 2: 95.23 vs 95.50); segprop above lw (93.69).
  scpl      scikit-learn digits, stratified 5-fold cross-validation repeated per seed (every one of the
            1,797 images is tested once per seed). convnet-digits in 3 components; Adam 1e-3 with a
            cosine schedule to 1e-5, temperature 0.1, projection heads Linear(dim, 512)-ReLU-Linear(512,
            1024) (appendix A.1). Two augmented views (crop 70-100% of the area, no flip: A.1's CIFAR
            crops down to 20% and flips destroy 8x8 digits); bp trains on the same two views; early_exit
            gets the same views and 512-wide local classifiers. Batch 32 for every arm.
            Claims: scpl within 1.5 points of bp (Table 7, vanilla ConvNet: 86.98 vs 86.85); scpl above
            early_exit (83.16).
  asyncfgd  Fashion-MNIST 60,000 / 10,000. FCS-Tanh (784-1024-512-256-10, Table 9) split into K = 3
            modules (Table 5); Adam, batch 64 (§6.1), lr from the paper's grid (--fgd-lr); one tangent,
            alpha = 1 (every layer perturbed, as Table 1's from-scratch runs). The default lr 1e-3 is the
            grid's best on a validation split (fgd, seed 0, one epoch on the first 50,000 training images,
            tested on the last 10,000: 1e-5 13.8%, 1e-4 16.6%, 1e-3 51.9%, 1e-2 15.7%). asyncfgd runs the
            deterministic reference scheduler (tested bit-identical to the threaded runtime).
            Claim: asyncfgd within 1 point of fgd (Table 1: |difference| <= 0.7 points on every model).
  subnet    scikit-learn digits, the same repeated 5-fold splits. N = 8 workers simulated in one process
            (method.SubnetDPSimulation, tested equal to the torchrun engine step by step), the ResNet-18
            layout at 1/8 width with GroupNorm(2); SGD Nesterov 0.9, weight decay 5e-4, cosine with 5%
            warm-up to 0.002 (§5 setup); batch 8 per worker (paper 64) and lr 0.05 (paper 0.2 at batch
            512); DP `epochs`, block masking P/N = 0.5 FLOP-matched (2 x epochs).
            Claim: block masking's unified model within 1.5 points of DP (Table 1: "largely unaffected").

Statistics (points = percentage points of test accuracy):
  * mean ± sample std over seeds of each arm;
  * the paired difference (first arm - second) per seed, its mean and (1 - 2 alpha) confidence interval;
  * Fashion-MNIST: a paired t-test over seeds (df = seeds - 1). Digits: the corrected repeated k-fold
    t-test of Nadeau & Bengio (2003) over the seed x fold differences (variance x (1/J + n_test/n_train),
    which accounts for the overlapping training sets), df = J - 1;
  * the exact Wilcoxon signed-rank test over the per-seed differences. With 3 seeds its smallest
    two-sided p is 0.25 and with 5 seeds 0.0625, so it cannot reach 0.05: it is reported, not used;
  * verdicts: "within m points" claims are equivalence tests (two one-sided tests): the 90% CI of the
    difference inside (-m, m) is reproduced, entirely outside it is not reproduced, otherwise
    inconclusive. "Above" claims: a two-sided p < 0.05 with the claimed sign is reproduced, with the
    opposite sign not reproduced, otherwise inconclusive.

Every run is appended to <out>/runs.jsonl as it finishes; a rerun with the same settings skips the runs
already there, so a killed study resumes. --report-only writes the table from whatever is there.

Default epochs: segprop 1 per stage, scpl 30, asyncfgd 1, subnet 10 (DP). The docs' run (docs/accuracy.md):

  OMP_NUM_THREADS=1 .venv/bin/python tools/study_accuracy.py --seeds 0,1,2 --jobs 2 --out out/study-accuracy
  OMP_NUM_THREADS=1 .venv/bin/python tools/study_accuracy.py --claims segprop,asyncfgd --seeds 0,1,2,3,4 \\
      --jobs 2 --out out/study-accuracy
  .venv/bin/python tools/study_accuracy.py --seeds 0,1,2,3,4 --out out/study-accuracy --report-only \\
      --png docs/img/accuracy-study.png
  .venv/bin/python tools/study_accuracy.py --quick --out /tmp/study-quick   # the smoke configuration
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

EXPERIMENTS = ("segprop", "scpl", "asyncfgd", "subnet")
ALPHA = 0.05
REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE, INCOMPLETE = "reproduced", "not reproduced", "inconclusive", "incomplete"


# -- statistics ----------------------------------------------------------------------------------------

def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1); std 0.0 for a single value."""
    if not values:
        raise ValueError("mean_std of no values")
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else 0.0)


def _t_sf(t: float, df: float) -> float:
    from scipy.stats import t as student_t

    return float(student_t.sf(t, df))


def _t_ppf(q: float, df: float) -> float:
    from scipy.stats import t as student_t

    return float(student_t.ppf(q, df))


@dataclass(frozen=True)
class TTest:
    """A t-test on paired differences: mean, its standard error, t, df, two-sided p and the
    (1 - 2 alpha) confidence interval of the mean difference (the TOST interval)."""
    n: int
    mean: float
    se: float
    t: float
    df: int
    p: float
    ci_low: float
    ci_high: float
    ci_level: float
    name: str


def _t_test(diffs: Sequence[float], variance_factor: float, name: str, alpha: float = ALPHA) -> TTest:
    """Shared core: se = sqrt(variance_factor * s^2); variance_factor = 1/n for the plain paired test."""
    n = len(diffs)
    if n < 2:
        raise ValueError(f"{name}: a paired test needs at least 2 differences, got {n}")
    mean, sd = mean_std(diffs)
    se = math.sqrt(variance_factor) * sd
    df = n - 1
    level = 1 - 2 * alpha
    if se == 0.0:  # every difference equal: no spread to test against
        t = 0.0 if mean == 0 else math.copysign(math.inf, mean)
        return TTest(n, mean, 0.0, t, df, 1.0 if mean == 0 else 0.0, mean, mean, level, name)
    t = mean / se
    p = min(1.0, 2 * _t_sf(abs(t), df))
    half = _t_ppf(1 - alpha, df) * se
    return TTest(n, mean, se, t, df, p, mean - half, mean + half, level, name)


def paired_t_test(a: Sequence[float], b: Sequence[float], alpha: float = ALPHA) -> TTest:
    """Student's paired t-test of a - b (two-sided p) with the (1 - 2 alpha) CI of the mean difference."""
    if len(a) != len(b):
        raise ValueError(f"paired test: {len(a)} vs {len(b)} values")
    diffs = [x - y for x, y in zip(a, b)]
    return _t_test(diffs, 1 / len(diffs), "paired t", alpha)


def corrected_kfold_t_test(diffs: Sequence[float], n_train: float, n_test: float, alpha: float = ALPHA) -> TTest:
    """Nadeau & Bengio's corrected resampled t-test for J = repeats x folds paired differences: the
    variance of the mean is s^2 x (1/J + n_test/n_train) instead of s^2 / J, because the training sets
    of the folds overlap (Bouckaert & Frank 2004 for repeated k-fold)."""
    return _t_test(diffs, 1 / len(diffs) + n_test / n_train, "corrected k-fold t", alpha)


def wilcoxon_signed_rank(diffs: Sequence[float]) -> tuple[float, float, int]:
    """Exact two-sided Wilcoxon signed-rank test: (W+, p, n used). Zero differences are dropped
    (Wilcoxon's rule); tied |d| get average ranks and the null distribution is enumerated over all
    2^n sign patterns of those ranks, so ties are exact too. p = 1.0 when nothing is left."""
    nonzero = [d for d in diffs if d != 0]
    n = len(nonzero)
    if n == 0:
        return 0.0, 1.0, 0
    if n > 20:
        raise ValueError("exact Wilcoxon: at most 20 non-zero differences")
    order = sorted(range(n), key=lambda i: abs(nonzero[i]))
    ranks = [0.0] * n
    i = 0
    while i < n:
        j = i
        while j + 1 < n and abs(nonzero[order[j + 1]]) == abs(nonzero[order[i]]):
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    w_plus = sum(r for r, d in zip(ranks, nonzero) if d > 0)
    expected = sum(ranks) / 2
    observed = abs(w_plus - expected)
    extreme = sum(1 for signs in itertools.product((0, 1), repeat=n)
                  if abs(sum(r for r, s in zip(ranks, signs) if s) - expected) >= observed - 1e-9)
    return w_plus, min(1.0, extreme / 2**n), n


def equivalence_verdict(ci_low: float, ci_high: float, margin: float) -> str:
    """Two one-sided tests at level alpha, read off the (1 - 2 alpha) CI of the difference: inside
    (-margin, margin) -> reproduced; entirely outside -> not reproduced; otherwise inconclusive."""
    if -margin < ci_low and ci_high < margin:
        return REPRODUCED
    if ci_low >= margin or ci_high <= -margin:
        return NOT_REPRODUCED
    return INCONCLUSIVE


def superiority_verdict(mean: float, p: float, alpha: float = ALPHA) -> str:
    """'first arm above the second': significant with the claimed sign -> reproduced, significant the
    other way -> not reproduced, otherwise inconclusive."""
    if p < alpha and mean > 0:
        return REPRODUCED
    if p < alpha and mean < 0:
        return NOT_REPRODUCED
    return INCONCLUSIVE


# -- settings ------------------------------------------------------------------------------------------

@dataclass
class Settings:
    """Everything a run depends on; its fingerprint keys the resume cache."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    epochs: dict[str, float] = field(default_factory=lambda: {"segprop": 1, "scpl": 30, "asyncfgd": 1, "subnet": 10})
    folds: int = 5
    fashion_train: int = 60000   # the first N training / test images as shipped
    fashion_test: int = 10000
    digits_limit: int = 0        # 0: all 1,797 digits (quick runs use fewer)
    segprop_width: int = 8
    segprop_batch: int = 64      # the paper: 256 at lr 3e-4 for 400 epochs per stage (see the module docstring)
    segprop_lr: float = 1e-3
    fgd_lr: float = 1e-3
    fgd_batch: int = 64
    scpl_batch: int = 32
    scpl_projection: tuple[int, int] = (512, 1024)
    subnet_batch: int = 8
    quick: bool = False

    def fingerprint(self, experiment: str) -> str:
        """What the experiment's runs depend on (seeds and other experiments' epochs excluded), so adding
        seeds or experiments reuses finished runs."""
        data = dataclasses.asdict(self)
        data.pop("seeds")
        data["epochs"] = data["epochs"].get(experiment)
        relevant = {"segprop": ("fashion", "segprop_"), "asyncfgd": ("fashion", "fgd_"),
                    "scpl": ("folds", "digits", "scpl_"), "subnet": ("folds", "digits", "subnet_")}[experiment]
        kept = {k: v for k, v in data.items() if k in ("epochs", "quick") or k.startswith(relevant)}
        return hashlib.sha256(json.dumps([experiment, kept], sort_keys=True).encode()).hexdigest()[:12]


def quick_settings() -> Settings:
    return Settings(epochs={"segprop": 1, "scpl": 1, "asyncfgd": 1, "subnet": 0.5}, folds=2, fashion_train=256,
                    fashion_test=200, digits_limit=360, segprop_batch=64, scpl_projection=(32, 32), quick=True)


@dataclass(frozen=True)
class Task:
    experiment: str
    arm: str
    seed: int
    fold: int | None = None  # digits experiments only

    @property
    def key(self) -> str:
        return f"{self.experiment}/{self.arm}/seed{self.seed}" + ("" if self.fold is None else f"/fold{self.fold}")


ARMS = {"segprop": ("bp", "segprop", "lw"), "scpl": ("bp", "scpl", "early_exit"),
        "asyncfgd": ("fgd", "asyncfgd"), "subnet": ("dp", "block P/N=0.5")}
DIGITS_EXPERIMENTS = ("scpl", "subnet")


@dataclass(frozen=True)
class Claim:
    name: str
    experiment: str
    first: str
    second: str
    kind: str            # "equivalent" or "superior"
    margin: float = 0.0  # points, for "equivalent"
    paper: str = ""


CLAIMS = (
    Claim("SegProp within 1.5 points of BP", "segprop", "segprop", "bp", "equivalent", 1.5,
          "ResNet-18 CIFAR-10: 95.23 vs 95.50 (Fig. 2a)"),
    Claim("SegProp above layer-wise", "segprop", "segprop", "lw", "superior", 0.0,
          "ResNet-18 CIFAR-10: 95.23 vs 93.69; ResNet-50: 94.34 vs 90.04"),
    Claim("SCPL within 1.5 points of BP", "scpl", "scpl", "bp", "equivalent", 1.5,
          "vanilla ConvNet CIFAR-10: 86.98 vs 86.85 (Table 7); margin ours"),
    Claim("SCPL above Early-Exit", "scpl", "scpl", "early_exit", "superior", 0.0,
          "vanilla ConvNet CIFAR-10: 86.98 vs 83.16 (Table 7)"),
    Claim("AsyncFGD within 1 point of FGD", "asyncfgd", "asyncfgd", "fgd", "equivalent", 1.0,
          "Table 1: |Async - FGD| <= 0.7 points on every MNIST / CIFAR-10 model"),
    Claim("Block masking P/N=0.5 within 1.5 points of DP", "subnet", "block P/N=0.5", "dp", "equivalent", 1.5,
          "ResNet-18 CIFAR-10 / 100, SVHN: 'largely unaffected' at P/N = 0.5 (Table 1)"),
)


def tasks_for(settings: Settings, experiments: Sequence[str]) -> list[Task]:
    tasks = []
    for experiment in experiments:
        folds = range(settings.folds) if experiment in DIGITS_EXPERIMENTS else [None]
        for seed in settings.seeds:
            for fold in folds:
                for arm in ARMS[experiment]:
                    tasks.append(Task(experiment, arm, seed, fold))
    return tasks


# -- data ----------------------------------------------------------------------------------------------

@lru_cache(maxsize=2)
def fashion(train_limit: int, test_limit: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Images [N, 1, 28, 28] in [0, 1]: the first train_limit / test_limit of each split as shipped."""
    from edgetrain.data import load_fashion_mnist

    train_x, train_y = load_fashion_mnist("train", image=True)
    test_x, test_y = load_fashion_mnist("test", image=True)
    return train_x[:train_limit], train_y[:train_limit], test_x[:test_limit], test_y[:test_limit]


@lru_cache(maxsize=1)
def all_digits(limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 1,797 digits as [N, 64] in [0, 1] (limit > 0: a stratified subset of that size)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    if limit:
        from sklearn.model_selection import train_test_split

        keep, _ = train_test_split(list(range(len(y))), train_size=limit, stratify=y.numpy(), random_state=0)
        keep = sorted(keep)
        x, y = x[keep], y[keep]
    return x, y


def digits_fold(limit: int, folds: int, seed: int, fold: int) -> tuple[torch.Tensor, ...]:
    """Train / test of one fold of a stratified k-fold split shuffled by `seed` (sklearn StratifiedKFold)."""
    from sklearn.model_selection import StratifiedKFold

    x, y = all_digits(limit)
    splitter = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
    train_idx, test_idx = list(splitter.split(x.numpy(), y.numpy()))[fold]
    train_idx, test_idx = torch.as_tensor(train_idx), torch.as_tensor(test_idx)
    return x[train_idx], y[train_idx], x[test_idx], y[test_idx]


def test_batches(x: torch.Tensor, y: torch.Tensor, size: int = 1000) -> list:
    from edgetrain.data.batch import Batch

    return [Batch(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


# -- the arms ------------------------------------------------------------------------------------------

def segprop_model(seed: int, width: int) -> torch.nn.Module:
    from torch import nn

    from edgetrain.models.resnet import ResNetConfig, build_resnet

    class MLPHead(nn.Module):
        """Appendix B.2: GAP, Linear C -> H (H = C), ReLU, dropout 0.3, Linear H -> classes."""

        def __init__(self, channels: int, classes: int) -> None:
            super().__init__()
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc1 = nn.Linear(channels, channels)
            self.act = nn.ReLU()
            self.drop = nn.Dropout(0.3)
            self.fc2 = nn.Linear(channels, classes)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.fc2(self.drop(self.act(self.fc1(self.pool(h).flatten(1)))))

    model = build_resnet(ResNetConfig(num_classes=10, in_channels=1, stem="cifar", width=width,
                                      blocks_per_stage=(1, 1, 1), seed=seed))
    torch.manual_seed(seed)
    model.head = MLPHead(width * 4, 10)
    return model


SEGPROP_PLAN = {"view": "resnet-paper", "head_blocks": 1, "segments": 3}


def run_segprop(task: Task, s: Settings) -> dict[str, Any]:
    from edgetrain.data import ArrayStream
    from edgetrain.recipes import run_schedule

    train_x, train_y, test_x, test_y = fashion(s.fashion_train, s.fashion_test)
    epochs = s.epochs["segprop"]
    stream = ArrayStream(train_x, train_y, batch_size=s.segprop_batch, shuffle=True, seed=task.seed)
    per_stage = epochs * SEGPROP_PLAN["segments"] if task.arm == "bp" else epochs
    result = run_schedule(segprop_model(task.seed, s.segprop_width), stream, task.arm, epochs_per_stage=per_stage,
                          optimizer="adamw", lr=s.segprop_lr, optimizer_options={"weight_decay": 0.01}, seed=task.seed,
                          eval_batches=test_batches(test_x, test_y), **({} if task.arm == "bp" else SEGPROP_PLAN))
    return {"accuracy": result.final["accuracy"], "test_size": len(test_y), "train_size": len(train_y),
            "steps": result.steps}


DIGITS_AUGMENT = {"flip": 0.0, "crop_scale": (0.7, 1.0)}


class _Views:
    """bp on the two augmented views SCPL and Early-Exit train on (same draws: same seed and batch index)."""

    def __init__(self, stream: Any, seed: int, steps: int) -> None:
        self.stream, self.seed, self.steps = stream, seed, steps

    def __iter__(self):
        from edgetrain.data.batch import Batch
        from edgetrain.methods.scpl.augment import augment_config, make_views

        for batch in itertools.islice(self.stream, self.steps):
            inputs, targets = make_views(batch.inputs, batch.targets, num_views=2, image_shape=(1, 8, 8),
                                         seed=self.seed, batch_index=batch.index,
                                         config=augment_config(DIGITS_AUGMENT))
            yield Batch(inputs, targets, batch.index)


def run_scpl(task: Task, s: Settings) -> dict[str, Any]:
    import edgetrain
    from edgetrain.data import ArrayStream
    from edgetrain.models.convnet import build_convnet, digits_convnet_config

    train_x, train_y, test_x, test_y = digits_fold(s.digits_limit, s.folds, task.seed, task.fold)
    epochs = s.epochs["scpl"]
    stream = ArrayStream(train_x, train_y, batch_size=s.scpl_batch, shuffle=True, seed=task.seed)
    total = math.ceil(epochs * stream.batches_per_epoch)
    options = {"bp": {},
               "scpl": {"projection_dims": tuple(s.scpl_projection), "temperature": 0.1, "augment": DIGITS_AUGMENT,
                        "seed": task.seed},
               "early_exit": {"classifier_hidden": 512, "augment": DIGITS_AUGMENT, "seed": task.seed}}[task.arm]
    model = build_convnet(dataclasses.replace(digits_convnet_config(), seed=task.seed))
    learner = edgetrain.Learner(model, method=task.arm, optimizer="adam", lr=1e-3, probe=False, seed=task.seed,
                                method_options=options, lr_schedule="cosine",
                                schedule_options={"total_steps": total, "min_lr_ratio": 0.01})
    for batch in (_Views(stream, task.seed, total) if task.arm == "bp" else itertools.islice(stream, total)):
        learner.step(batch)
    metrics = learner.evaluate(test_batches(test_x, test_y))
    return {"accuracy": metrics["accuracy"], "test_size": len(test_y), "train_size": len(train_y), "steps": total}


def run_asyncfgd(task: Task, s: Settings) -> dict[str, Any]:
    import edgetrain
    import edgetrain.methods.asyncfgd  # noqa: F401  (registers asyncfgd)
    import edgetrain.methods.fgd  # noqa: F401
    from edgetrain.data import ArrayStream
    from edgetrain.models.mlp import build_mlp, fcs_config

    train_x, train_y, test_x, test_y = fashion(s.fashion_train, s.fashion_test)
    model = build_mlp(dataclasses.replace(fcs_config("tanh", (1, 28, 28)), seed=task.seed))
    options = {"seed": task.seed} if task.arm == "fgd" else {"seed": task.seed, "num_modules": 3,
                                                              "runtime": "reference"}
    learner = edgetrain.Learner(model, method=task.arm, optimizer="adam", lr=s.fgd_lr, probe=False, seed=task.seed,
                                method_options=options)
    stream = ArrayStream(train_x, train_y, batch_size=s.fgd_batch, shuffle=True, seed=task.seed)
    steps = math.ceil(s.epochs["asyncfgd"] * stream.batches_per_epoch)
    try:
        for batch in itertools.islice(stream, steps):
            learner.step(batch)
    finally:
        getattr(learner.method, "close", lambda: None)()
    metrics = learner.evaluate(test_batches(test_x, test_y))
    return {"accuracy": metrics["accuracy"], "test_size": len(test_y), "train_size": len(train_y), "steps": steps}


def run_subnet(task: Task, s: Settings) -> dict[str, Any]:
    from edgetrain.recipes.subnet_dp.trainer import SubnetDPConfig, train_simulated
    from edgetrain.models.resnet_subnet import digits_subnet_config

    train_x, train_y, test_x, test_y = digits_fold(s.digits_limit, s.folds, task.seed, task.fold)
    train = (train_x.reshape(-1, 1, 8, 8), train_y)
    test = (test_x.reshape(-1, 1, 8, 8), test_y)
    overlap = 8 if task.arm == "dp" else 4
    config = SubnetDPConfig(masking="block", overlap=overlap, epochs=s.epochs["subnet"], flop_matched=True,
                            batch_size=s.subnet_batch, lr=0.05, mask_seed=task.seed, data_seed=task.seed)
    result = train_simulated(digits_subnet_config(seed=task.seed), train, test, config, 8)
    return {"accuracy": result["test"]["accuracy"], "test_size": len(test_y), "train_size": len(train_y),
            "steps": result["steps"], "ensemble": result["test_ensemble"]["accuracy"],
            "subnetworks": result["test_subnetwork"]["accuracy"]}


RUNNERS = {"segprop": run_segprop, "scpl": run_scpl, "asyncfgd": run_asyncfgd, "subnet": run_subnet}


def run_task(task: Task, settings: Settings) -> dict[str, Any]:
    """One training run, one intra-op thread (a fixed reduction order; no OpenMP spinning on shared cores)."""
    torch.set_num_threads(1)
    start = time.perf_counter()
    found = RUNNERS[task.experiment](task, settings)
    found["correct"] = round(found["accuracy"] * found["test_size"])
    return {"key": task.key, **dataclasses.asdict(task), "fingerprint": settings.fingerprint(task.experiment),
            "seconds": round(time.perf_counter() - start, 2), **found}


# -- running -------------------------------------------------------------------------------------------

def load_runs(path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """(fingerprint, key) -> record, from a runs.jsonl (a torn last line from a kill is skipped)."""
    runs = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            runs[(record["fingerprint"], record["key"])] = record
    return runs


def run_all(tasks: list[Task], settings: Settings, runs_path: Path, jobs: int) -> dict[tuple[str, str], dict]:
    runs = load_runs(runs_path)
    # In the order given: experiment by experiment (--claims order), seed by seed, so an interrupted
    # study leaves whole seeds of the first experiments behind.
    todo = [t for t in tasks if (settings.fingerprint(t.experiment), t.key) not in runs]
    print(f"{len(tasks) - len(todo)} of {len(tasks)} runs already in {runs_path}; {len(todo)} to run "
          f"({jobs} at a time)", flush=True)
    start = time.perf_counter()

    def record(result: dict[str, Any], done: int) -> None:
        runs[(result["fingerprint"], result["key"])] = result
        with runs_path.open("a") as handle:
            handle.write(json.dumps(result) + "\n")
        print(f"[{done}/{len(todo)} {time.perf_counter() - start:7.0f} s] {result['key']}: "
              f"accuracy {result['accuracy']:.4f} ({result['seconds']:.0f} s)", flush=True)

    if jobs <= 1:
        for done, task in enumerate(todo, 1):
            record(run_task(task, settings), done)
    elif todo:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            futures = [pool.submit(run_task, task, settings) for task in todo]
            for done, future in enumerate(as_completed(futures), 1):
                record(future.result(), done)
    return runs


# -- analysis ------------------------------------------------------------------------------------------

def per_seed(runs: dict, settings: Settings, experiment: str, arm: str) -> dict[int, dict[str, Any]]:
    """seed -> {"accuracy": pooled over folds, "folds": [fold accuracies]} for the seeds with every run done."""
    fingerprint = settings.fingerprint(experiment)
    folds = list(range(settings.folds)) if experiment in DIGITS_EXPERIMENTS else [None]
    found = {}
    for seed in settings.seeds:
        records = [runs.get((fingerprint, Task(experiment, arm, seed, fold).key)) for fold in folds]
        if any(r is None for r in records):
            continue
        correct, total = sum(r["correct"] for r in records), sum(r["test_size"] for r in records)
        found[seed] = {"accuracy": correct / total, "folds": [r["accuracy"] for r in records],
                       "train_sizes": [r["train_size"] for r in records],
                       "test_sizes": [r["test_size"] for r in records],
                       "seconds": sum(r["seconds"] for r in records)}
    return found


def analyse_claim(claim: Claim, runs: dict, settings: Settings) -> dict[str, Any]:
    first = per_seed(runs, settings, claim.experiment, claim.first)
    second = per_seed(runs, settings, claim.experiment, claim.second)
    seeds = sorted(set(first) & set(second))
    out: dict[str, Any] = {"claim": claim.name, "experiment": claim.experiment, "arms": [claim.first, claim.second],
                           "kind": claim.kind, "margin_points": claim.margin, "paper": claim.paper, "seeds": seeds,
                           "per_seed": {claim.first: {s: 100 * first[s]["accuracy"] for s in seeds},
                                        claim.second: {s: 100 * second[s]["accuracy"] for s in seeds}}}
    if len(seeds) < 2:
        out["verdict"] = INCOMPLETE
        out["note"] = f"{len(seeds)} seed(s) finished; a paired test needs 2 or more"
        return out
    a = [100 * first[s]["accuracy"] for s in seeds]
    b = [100 * second[s]["accuracy"] for s in seeds]
    diffs = [x - y for x, y in zip(a, b)]
    out["mean_std"] = {claim.first: mean_std(a), claim.second: mean_std(b)}
    out["differences"] = diffs
    if claim.experiment in DIGITS_EXPERIMENTS:
        unit_diffs = [100 * (fa - fb) for s in seeds for fa, fb in zip(first[s]["folds"], second[s]["folds"])]
        n_train = statistics.fmean(n for s in seeds for n in first[s]["train_sizes"])
        n_test = statistics.fmean(n for s in seeds for n in first[s]["test_sizes"])
        test = corrected_kfold_t_test(unit_diffs, n_train, n_test)
        out["fold_differences"] = unit_diffs
        out["paired_t_over_seeds"] = dataclasses.asdict(paired_t_test(a, b))
    else:
        test = paired_t_test(a, b)
    out["test"] = dataclasses.asdict(test)
    w_plus, w_p, w_n = wilcoxon_signed_rank(diffs)
    out["wilcoxon"] = {"w_plus": w_plus, "p": w_p, "n": w_n,
                       "smallest_possible_p": 2 / 2**w_n if w_n else 1.0}
    if claim.kind == "equivalent":
        out["verdict"] = equivalence_verdict(test.ci_low, test.ci_high, claim.margin)
    else:
        out["verdict"] = superiority_verdict(test.mean, test.p)
    return out


def format_points(mean: float, std: float) -> str:
    return f"{mean:.2f} ± {std:.2f}"


def markdown_table(results: list[dict[str, Any]], datasets: dict[str, str]) -> str:
    lines = ["| claim | data | arms | first arm | second arm | difference [90% CI] | test | p | p, seeds only | "
             "Wilcoxon p | verdict |", "| --- | --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- |"]
    for r in results:
        arms = " vs ".join(r["arms"])
        if r["verdict"] == INCOMPLETE:
            lines.append(f"| {r['claim']} | {datasets[r['experiment']]} | {arms} | | | | | | | | "
                         f"incomplete: {r['note']} |")
            continue
        t = r["test"]
        first, second = (format_points(*r["mean_std"][arm]) for arm in r["arms"])
        data = f"{datasets[r['experiment']]}, {len(r['seeds'])} seeds"  # the seeds with both arms finished
        lines.append(f"| {r['claim']} | {data} | {arms} | {first} | {second} | "
                     f"{t['mean']:+.2f} [{t['ci_low']:+.2f}, {t['ci_high']:+.2f}] | {t['name']}, n={t['n']} | "
                     f"{t['p']:.3f} | {r.get('paired_t_over_seeds', t)['p']:.3f} | {r['wilcoxon']['p']:.3f} | "
                     f"**{r['verdict']}** |")
    return "\n".join(lines)


def dataset_labels(settings: Settings) -> dict[str, str]:
    fashion_label = f"Fashion-MNIST {settings.fashion_train:,}/{settings.fashion_test:,}"
    digits_label = f"digits {settings.folds}-fold" + (f" ({settings.digits_limit})" if settings.digits_limit else "")
    return {"segprop": fashion_label, "asyncfgd": fashion_label, "scpl": digits_label, "subnet": digits_label}


def write_png(path: Path, results: list[dict[str, Any]]) -> Path | None:
    """One panel per claim: each seed's accuracy of both arms as grey dots joined by a line (the
    pairing), and each arm's mean ± std (blue square and error bar) beside them."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: PNG skipped")
        return None
    shown = [r for r in results if r["verdict"] != INCOMPLETE]
    if not shown:
        return None
    columns = min(3, len(shown))
    rows = math.ceil(len(shown) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.6 * rows), squeeze=False)
    colours = {REPRODUCED: "tab:green", NOT_REPRODUCED: "tab:red", INCONCLUSIVE: "tab:orange"}
    for ax, r in zip(axes.flat, shown):
        arms = r["arms"]
        means = [r["mean_std"][arm][0] for arm in arms]
        stds = [r["mean_std"][arm][1] for arm in arms]
        for seed in r["seeds"]:  # the pairing: one line per seed
            ys = [r["per_seed"][arm][seed] for arm in arms]
            ax.plot([-0.1, 0.9], ys, color="grey", alpha=0.6, linewidth=0.8, marker="o", markersize=4, zorder=2)
        ax.errorbar([0.12, 1.12], means, yerr=stds, fmt="s", color="tab:blue", markersize=7, capsize=6,
                    linewidth=1.5, zorder=3, label="mean ± std")
        values = [v for arm in arms for v in r["per_seed"][arm].values()]
        low, high = min(values), max(values)
        pad = max(1.0, 0.6 * (high - low))
        ax.set_ylim(low - pad, high + pad)
        ax.set_xticks([0, 1], arms)
        ax.set_xlim(-0.5, 1.5)
        ax.grid(axis="y", alpha=0.3)
        ax.set_ylabel("test accuracy (%)")
        t = r["test"]
        ax.set_title(f"{r['claim']}\n{t['mean']:+.2f} pts [{t['ci_low']:+.2f}, {t['ci_high']:+.2f}], p={t['p']:.3f}: "
                     f"{r['verdict']}", fontsize=8.5, color=colours.get(r["verdict"], "black"))
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


# -- command line --------------------------------------------------------------------------------------

def parse_epochs(text: str | None, base: dict[str, float]) -> dict[str, float]:
    """'2' sets every experiment; 'segprop=1,scpl=40' sets those named."""
    epochs = dict(base)
    if not text:
        return epochs
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep:
            epochs = {k: float(name) for k in epochs}
        elif name.strip() in epochs:
            epochs[name.strip()] = float(value)
        else:
            raise SystemExit(f"--epochs: unknown experiment {name!r} (known: {', '.join(EXPERIMENTS)})")
    return epochs


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--claims", default=",".join(EXPERIMENTS),
                        help=f"experiments to run, comma-separated: {', '.join(EXPERIMENTS)} (default all)")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--epochs", default=None,
                        help="one number for every experiment, or e.g. segprop=1,scpl=30,asyncfgd=1,subnet=10 "
                             "(segprop: per stage; subnet: DP's, block masking runs 2x)")
    parser.add_argument("--folds", type=int, default=None, help="digits: k of the repeated k-fold (default 5)")
    parser.add_argument("--fgd-lr", type=float, default=None, help="asyncfgd / fgd Adam lr (default 1e-3)")
    parser.add_argument("--quick", action="store_true", help="a tiny smoke configuration (seconds, not a result)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time, one process and one thread each")
    parser.add_argument("--out", type=Path, default=Path("out/study-accuracy"),
                        help="directory: runs.jsonl (every run, for resuming), study.json, table.md, study.png")
    parser.add_argument("--png", type=Path, default=None, help="also write the figure here")
    parser.add_argument("--report-only", action="store_true", help="no training: the report from runs.jsonl")
    args = parser.parse_args(argv)

    settings = quick_settings() if args.quick else Settings()
    if args.seeds:
        settings.seeds = [int(s) for s in args.seeds.split(",")]
    settings.epochs = parse_epochs(args.epochs, settings.epochs)
    if args.folds:
        settings.folds = args.folds
    if args.fgd_lr:
        settings.fgd_lr = args.fgd_lr
    experiments = [e.strip() for e in args.claims.split(",") if e.strip()]
    unknown = sorted(set(experiments) - set(EXPERIMENTS))
    if unknown:
        raise SystemExit(f"--claims: unknown {', '.join(unknown)} (known: {', '.join(EXPERIMENTS)})")
    if len(settings.seeds) < 2:
        raise SystemExit("--seeds: a paired test needs at least 2 seeds (3 or more for anything worth reading)")

    args.out.mkdir(parents=True, exist_ok=True)
    runs_path = args.out / "runs.jsonl"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# {platform.node()}, torch {torch.__version__}, {cores} cores, load average {load:.1f}; "
          f"settings {json.dumps(dataclasses.asdict(settings))}", flush=True)
    start = time.perf_counter()
    tasks = tasks_for(settings, experiments)
    runs = load_runs(runs_path) if args.report_only else run_all(tasks, settings, runs_path, args.jobs)
    results = [analyse_claim(c, runs, settings) for c in CLAIMS if c.experiment in experiments]
    labels = dataset_labels(settings)
    table = markdown_table(results, labels)
    command = "tools/study_accuracy.py " + " ".join(sys.argv[1:] if argv is None else argv)
    arm_seconds = {e: {arm: sum(r["seconds"] for s in settings.seeds for r in [per_seed(runs, settings, e, arm)
                                                                                .get(s, {"seconds": 0.0})])
                       for arm in ARMS[e]} for e in experiments}
    payload = {"command": command, "settings": dataclasses.asdict(settings), "experiments": experiments,
               "wall_seconds_this_call": round(time.perf_counter() - start, 1), "run_seconds": arm_seconds,
               "machine": {"node": platform.node(), "cores": cores, "load_average_at_start": load,
                           "torch": torch.__version__},
               "claims": results,
               "runs": [r for (fp, _), r in sorted(runs.items(), key=lambda kv: kv[0][1])
                        if any(fp == settings.fingerprint(e) for e in experiments)]}
    from edgetrain.training.checkpoint import atomic_write_json

    atomic_write_json(payload, args.out / "study.json")
    (args.out / "table.md").write_text(table + "\n")
    png = write_png(args.out / "study.png", results)
    if png is not None and args.png is not None:
        write_png(args.png, results)
    print("\n" + table)
    print("\nverdicts: equivalence = the 90% CI of the difference inside ±margin (TOST, alpha 0.05); "
          "'above' = paired two-sided p < 0.05 with the claimed sign. Digits: p and CI from the corrected "
          "repeated k-fold t-test over seed x fold; Fashion-MNIST: paired t over seeds.")
    print(f"wrote {args.out / 'study.json'}, {args.out / 'table.md'}" + (f", {png}" if png else ""))
    return payload


if __name__ == "__main__":
    main()
