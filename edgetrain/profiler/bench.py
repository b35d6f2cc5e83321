"""The benchmark protocol every tools/bench_*.py shares: warm-up, interleaved order, repeats, median and
spread, ratios to a named baseline, one table, JSON and a PNG.

Absolute times on a shared machine mean little; ratios of arms measured in the same rounds mean more.
So each round runs every arm once, and the order alternates between rounds (A B C, then C B A, ...):
a machine that slows down during the run slows every arm alike instead of the last one.
"""
from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from edgetrain.registry import EdgetrainError
from edgetrain.utils.progress import progress_bar

# One measurement of one arm: metric name -> value (seconds, bytes, ...); None where not measured.
Sample = Mapping[str, float | None]


@dataclass(frozen=True)
class Arm:
    name: str
    run: Callable[[], Sample]


@dataclass(frozen=True)
class Summary:
    median: float
    low: float
    high: float
    count: int

    @property
    def spread(self) -> float:
        """(high - low) / median: how far apart the repeats were, as a fraction of the median."""
        return (self.high - self.low) / self.median if self.median else 0.0


def round_orders(arm_names: Sequence[str], rounds: int) -> list[list[str]]:
    """The order of the arms in each round: as given, then reversed, alternately."""
    return [list(arm_names) if index % 2 == 0 else list(reversed(arm_names)) for index in range(rounds)]


def measure_interleaved(arms: Sequence[Arm], *, repeats: int = 3, warmup: int = 1, progress: bool = True,
                        description: str = "bench") -> dict[str, list[Sample]]:
    """Run every arm `warmup` times (discarded), then `repeats` rounds in alternating order; the samples of
    each arm, in the order they were taken."""
    if repeats < 1 or warmup < 0:
        raise EdgetrainError(f"benchmark: repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    names = [arm.name for arm in arms]
    if len(set(names)) != len(names):
        raise EdgetrainError(f"benchmark: arm names must differ, got {names}")
    by_name = {arm.name: arm for arm in arms}
    samples: dict[str, list[Sample]] = {name: [] for name in names}
    with progress_bar((warmup + repeats) * len(arms), description=description, unit="run",
                      enabled=progress) as bar:
        for order in round_orders(names, warmup):
            for name in order:
                by_name[name].run()
                bar.update()
        for order in round_orders(names, repeats):
            for name in order:
                samples[name].append(dict(by_name[name].run()))
                bar.update()
    return samples


def summarise(samples: Sequence[Sample]) -> dict[str, Summary]:
    """Median, lowest and highest value of each metric over the samples that measured it."""
    metrics = sorted({metric for sample in samples for metric in sample})
    summaries = {}
    for metric in metrics:
        values = [float(sample[metric]) for sample in samples if sample.get(metric) is not None]
        if values:
            summaries[metric] = Summary(statistics.median(values), min(values), max(values), len(values))
    return summaries


def ratios(summaries: Mapping[str, Mapping[str, Summary]], baseline: str) -> dict[str, dict[str, float | None]]:
    """Each arm's median of each metric divided by the baseline arm's (None where either is missing or the
    baseline's is 0)."""
    if baseline not in summaries:
        raise EdgetrainError(f"benchmark: baseline {baseline!r} is not one of the arms {sorted(summaries)}")
    reference = summaries[baseline]
    result: dict[str, dict[str, float | None]] = {}
    for arm, by_metric in summaries.items():
        result[arm] = {}
        for metric, summary in by_metric.items():
            base = reference.get(metric)
            result[arm][metric] = summary.median / base.median if base is not None and base.median else None
    return result


@dataclass(frozen=True)
class Column:
    metric: str
    label: str
    scale: float = 1.0   # divide values by this for display (2**20: bytes as MiB)
    unit: str = ""


def format_table(title: str, summaries: Mapping[str, Mapping[str, Summary]], baseline: str,
                 columns: Sequence[Column]) -> str:
    """One row per arm: each column's median (with its spread over repeats) and its ratio to `baseline`."""
    relative = ratios(summaries, baseline)
    heads = [f"{c.label}{f' ({c.unit})' if c.unit else ''}" for c in columns]
    width = max([len("arm"), *(len(arm) for arm in summaries)])
    lines = [title, f"{'arm':<{width}}" + "".join(f"  {head:>30}" for head in heads)]
    for arm, by_metric in summaries.items():
        cells = []
        for column in columns:
            summary = by_metric.get(column.metric)
            if summary is None:
                cells.append(f"  {'-':>30}")
                continue
            ratio = relative[arm].get(column.metric)
            text = f"{summary.median / column.scale:,.3g} ±{100 * summary.spread:.0f}%"
            text += f" ({ratio:.2f}x)" if ratio is not None else " (-)"
            cells.append(f"  {text:>30}")
        lines.append(f"{arm:<{width}}" + "".join(cells))
    lines.append(f"(median over repeats, ±: spread (max - min) / median; ratios to {baseline})")
    return "\n".join(lines)


def write_json(path: str | Path, summaries: Mapping[str, Mapping[str, Summary]], baseline: str,
               samples: Mapping[str, Sequence[Sample]] | None = None, **context: Any) -> Path:
    """Summaries, ratios, the raw samples and whatever context (machine, settings) as one JSON file."""
    from edgetrain.training.checkpoint import atomic_write_json

    payload = {"baseline": baseline, "context": context,
               "summaries": {arm: {m: asdict(s) for m, s in by.items()} for arm, by in summaries.items()},
               "ratios": ratios(summaries, baseline),
               "samples": {arm: [dict(s) for s in taken] for arm, taken in (samples or {}).items()}}
    json.dumps(payload)  # refuse a value JSON cannot hold before anything is written
    atomic_write_json(payload, path)
    return Path(path)


def write_png(path: str | Path, summaries: Mapping[str, Mapping[str, Summary]], baseline: str,
              column: Column, title: str = "") -> Path:
    """A bar per arm: the column's ratio to the baseline, with the repeats' range as an error bar."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise EdgetrainError(f"benchmark PNG needs matplotlib (pip install 'edgetrain[plot]'): {exc}") from None
    base = summaries[baseline][column.metric].median
    arms = [arm for arm, by in summaries.items() if column.metric in by]
    medians = [summaries[arm][column.metric].median / base for arm in arms]
    lows = [m - summaries[arm][column.metric].low / base for m, arm in zip(medians, arms)]
    highs = [summaries[arm][column.metric].high / base - m for m, arm in zip(medians, arms)]
    figure, axes = plt.subplots(figsize=(max(4.0, 1.1 * len(arms)), 3.2))
    axes.bar(arms, medians, yerr=[lows, highs], capsize=4)
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set_ylabel(f"{column.label} / {baseline}")
    axes.set_title(title or column.label)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
