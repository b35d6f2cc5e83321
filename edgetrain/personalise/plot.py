"""A picture of the personaliser's history (`edgetrain personalise status --plot FILE`): two panels over the
window number.

- Top: each candidate's held-out metric against what it had to beat (its start's score, a short grey bar),
  with the margin it had to beat it by shaded.
- Bottom: each candidate's retain-set score against the base model's, with the forgetting guard's limit
  (the base's score moved by retain_margin) dashed.

Promoted windows are filled green circles (with the version they became), rejected ones red crosses with
the side that failed ("held out", "forgetting", "both"); a window whose training failed is a grey line.
matplotlib (the `plot` extra) is imported when a picture is asked for, never by `status` alone. The file is
rendered in memory and written atomically: a failed save leaves the previous picture, or none.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Sequence

from edgetrain.personalise.errors import PersonaliseError
from edgetrain.personalise.history import GateRecord

PROMOTED_COLOUR, REJECTED_COLOUR, REFERENCE_COLOUR = "tab:green", "tab:red", "0.35"
# Past this many windows the per-window labels overlap: the markers (and the legend) say it alone.
MAX_LABELS = 40
REASON_LABELS = {("held_out",): "held out", ("forgetting",): "forgetting", ("held_out", "forgetting"): "both"}
FAILED_TRAINING = "training failed"
# A label sits on a white patch: it often falls on the grey bar of what the candidate had to beat.
LABEL_BOX = dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.85)


class PlotError(PersonaliseError):
    """The history cannot be drawn as asked."""


class PlotUnavailableError(PlotError):
    """matplotlib, which draws the picture, is not installed (the `plot` extra)."""


class PlotFormatError(PlotError, ValueError):
    """The picture's file name ends in a suffix matplotlib cannot write."""


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: the picture goes to a file
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailableError("drawing the history needs matplotlib: pip install 'edgetrain[plot]'") from None
    return plt


def plot_format(path: str | Path) -> str:
    """The format `path`'s suffix names (png, svg, pdf, ...), or PlotFormatError naming the suffix and the
    ones matplotlib writes; PlotUnavailableError without matplotlib. Asked before any work is done."""
    _pyplot()
    from matplotlib.backend_bases import FigureCanvasBase

    supported = sorted(FigureCanvasBase.get_supported_filetypes())
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in supported:
        said = f"its suffix .{suffix}" if suffix else "it has no suffix"
        raise PlotFormatError(f"cannot draw the history to {path}: {said} is not a picture format matplotlib "
                              f"writes (one of: {', '.join('.' + s for s in supported)})")
    return suffix


def _metric_label(metric: str | None, higher_is_better: bool) -> str:
    direction = "higher" if higher_is_better else "lower"
    return f"{metric or 'metric'} ({direction} is better)"


def _mark(axis: Any, rows: Sequence[GateRecord], values: Sequence[float | None]) -> None:
    """The candidates' markers: promoted filled green circles, rejected red crosses."""
    for promoted, colour, marker, label in ((True, PROMOTED_COLOUR, "o", "promoted"),
                                            (False, REJECTED_COLOUR, "x", "rejected")):
        points = [(row.window, value) for row, value in zip(rows, values)
                  if row.promoted == promoted and value is not None]
        if points:
            axis.scatter(*zip(*points), color=colour, marker=marker, s=60, linewidths=2.2, zorder=3,
                         label=f"candidate, {label}")


def _failed_windows(axis: Any, failed: Sequence[GateRecord]) -> None:
    """Windows rejected before they were judged (their training failed): a grey line, no figure."""
    for number, row in enumerate(failed):
        axis.axvline(row.window, color="0.6", linestyle=":", linewidth=1.5,
                     label=FAILED_TRAINING if number == 0 else None)


def _label(axis: Any, text: str, window: int, value: float, colour: str) -> None:
    axis.annotate(text, (window, value), textcoords="offset points", xytext=(0, 10), ha="center", fontsize=8,
                  color=colour, bbox=LABEL_BOX, zorder=4)


def _held_out_panel(axis: Any, rows: Sequence[GateRecord], failed: Sequence[GateRecord], labels: bool) -> None:
    windows = [row.window for row in rows]
    references = [row.reference for row in rows]
    axis.hlines(references, [w - 0.35 for w in windows], [w + 0.35 for w in windows], color=REFERENCE_COLOUR,
                linewidth=2.5, zorder=2, label="to beat: its start's score")
    # The margin: the band between the start's score and the score the candidate had to reach.
    needed = [(row.window, row.reference, row.needed) for row in rows if row.needed not in (None, row.reference)]
    if needed:
        axis.bar([w for w, _, _ in needed], [n - r for _, r, n in needed], bottom=[r for _, r, _ in needed],
                 width=0.7, color=REFERENCE_COLOUR, alpha=0.2, zorder=1, label="the margin to beat it by")
    axis.plot(windows, [row.value for row in rows], color="0.75", linewidth=1, zorder=2)
    _mark(axis, rows, [row.value for row in rows])
    _failed_windows(axis, failed)
    if labels:
        for row in rows:
            text = f"v{row.version}" if row.promoted else REASON_LABELS.get(row.failed, row.reason)
            _label(axis, text, row.window, row.value, PROMOTED_COLOUR if row.promoted else REJECTED_COLOUR)
    # Room above the highest point for its label; the margin bars' edges would otherwise pin the axis to them.
    axis.use_sticky_edges = False
    axis.margins(y=0.15)
    axis.set_ylabel(f"held-out {_metric_label(rows[0].metric, rows[0].higher_is_better)}")
    axis.set_title("the user's held-out examples: candidate against its start", fontsize=10, loc="left")
    axis.legend(fontsize=8, loc="best")


def _retain_panel(axis: Any, rows: Sequence[GateRecord], failed: Sequence[GateRecord], labels: bool) -> None:
    guarded = [row for row in rows if row.retain is not None]
    if not guarded:
        axis.text(0.5, 0.5, "forgetting guard off: no retain-set score", transform=axis.transAxes, ha="center",
                  va="center", color="0.4")
        axis.set_yticks([])
        axis.set_title("the retain set (what the model knew)", fontsize=10, loc="left")
        return
    windows = [row.window for row in guarded]
    axis.plot(windows, [row.retain_base for row in guarded], color=REFERENCE_COLOUR, linewidth=2,
              drawstyle="steps-mid", zorder=2, label="base model")
    limits = [(row.window, row.retain_limit) for row in guarded if row.retain_limit is not None]
    if limits:
        margins = sorted({row.retain_margin for row in guarded if row.retain_margin is not None})
        said = ", ".join(f"{m:g}" for m in margins)
        axis.plot(*zip(*limits), color=REJECTED_COLOUR, linestyle="--", linewidth=1.2, drawstyle="steps-mid",
                  label=f"guard's limit (retain_margin {said})")
    axis.plot(windows, [row.retain for row in guarded], color="0.75", linewidth=1, zorder=2)
    _mark(axis, guarded, [row.retain for row in guarded])
    _failed_windows(axis, failed)
    if labels:
        for row in guarded:
            if "forgetting" in row.failed and row.retain_worsened is not None:
                worse = f"{row.retain_worsened:+.1%}" if not row.higher_is_better else \
                    f"{-row.retain_worsened:+.3g} points"
                _label(axis, f"{worse} on the base", row.window, row.retain, REJECTED_COLOUR)
    axis.margins(y=0.15)
    axis.set_ylabel(f"retain-set {_metric_label(guarded[0].metric, guarded[0].higher_is_better)}")
    axis.set_title("the retain set (what the model knew): candidate against the base model", fontsize=10,
                   loc="left")
    axis.legend(fontsize=8, loc="best")


def summary(rows: Sequence[GateRecord]) -> str:
    """'N windows: P promoted, R rejected (...)': the picture's title line, and what the CLI prints."""
    promoted = sum(row.promoted for row in rows)
    rejected = [REASON_LABELS.get(row.failed, FAILED_TRAINING) for row in rows if not row.promoted]
    detail = ", ".join(f"{rejected.count(label)} {label}" for label in (*REASON_LABELS.values(), FAILED_TRAINING)
                       if label in rejected)
    return (f"{len(rows)} window{'s' if len(rows) != 1 else ''}: {promoted} promoted, {len(rows) - promoted} "
            f"rejected" + (f" ({detail})" if detail else ""))


def plot_history(rows: Sequence[GateRecord], path: str | Path, title: str | None = None) -> Path:
    """Draw the gates `rows` (edgetrain.personalise.history.gate_history) to `path`, in the format its suffix
    names; returns the path. PlotError when there is nothing to draw, the suffix is not a picture format or
    matplotlib is missing."""
    path = Path(path)
    suffix = plot_format(path)
    if not rows:
        raise PlotError(f"no gate to draw to {path}: the history begins when the first window ends")
    judged = [row for row in rows if row.value is not None]
    failed = [row for row in rows if row.value is None]  # training failed: no figures
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    from edgetrain.files.atomic import atomic_write_bytes

    figure, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 7))
    try:
        labels = len(rows) <= MAX_LABELS
        if judged:
            _held_out_panel(top, judged, failed, labels)
            _retain_panel(bottom, judged, failed, labels)
        else:
            _failed_windows(top, failed)
            top.legend(fontsize=8)
        bottom.set_xlabel("window")
        bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
        windows = [row.window for row in rows]
        bottom.set_xlim(min(windows) - 0.7, max(windows) + 0.7)
        figure.suptitle((f"{title}\n" if title else "") + summary(rows), fontsize=11)
        figure.tight_layout()
        # Rendered in memory, then written atomically: a failed or killed save keeps the previous picture.
        image = io.BytesIO()
        figure.savefig(image, dpi=110, format=suffix)
    finally:
        plt.close(figure)
    return atomic_write_bytes(image.getvalue(), path)
