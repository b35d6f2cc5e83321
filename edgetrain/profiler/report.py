"""Turn profile records into what people read: a table with ratios, JSON records, a PNG chart."""
from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from edgetrain.profiler.config import RECORD_FIELDS
from edgetrain.profiler.step_breakdown import breakdown_line
from edgetrain.registry import EdgetrainError
from edgetrain.training.checkpoint import atomic_write_bytes

MIB = 2**20


def _ratio(value: float | None, reference: float | None) -> str:
    if value is None or not reference:
        return "-"
    return f"{value / reference:.2f}x"


def _mib(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / MIB:.1f}" if value >= 10 * MIB else f"{value / MIB:.3f}"


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _gradient_reference_line(records: list[dict[str, Any]]) -> str:
    """Which gradient the "vs ref" columns compare with: the records say (the torch profiler's is bp in
    float64 on a float64 copy of the model, so fp32 bp's own error shows too)."""
    references = sorted({str(r["grad_reference"]) for r in records if r.get("grad_reference")})
    if not references:
        compared = any(r.get("grad_cosine") is not None for r in records)
        return "\ngradients vs ref: against the backend's own bp on the same batch and weights" if compared else ""
    return (f"\ngradients vs ref: cosine and max relative error against {' / '.join(references)} on the same "
            "batch and weights (every method's own error, the first method's included)")


# Cores' worth of CPU other processes may use differently while two methods are timed before their time
# ratio stops meaning anything: beside a busy core a step can take many times longer (docs/benchmarks.md).
LOAD_CHANGE_CORES = 0.5


def load_changed_under(records: list[dict[str, Any]]) -> str:
    """A line saying the load changed under the run (and why no time ratio is printed), or "" when it did not
    or was not read."""
    loads = [r["others_busy_cores"] for r in records if r.get("others_busy_cores") is not None]
    if len(loads) < 2 or max(loads) - min(loads) < LOAD_CHANGE_CORES:
        return ""
    return (f"time ratios not printed: the load changed under this run (other processes kept "
            f"{min(loads):.1f} to {max(loads):.1f} cores busy while methods were timed); run it again on a "
            "steadier machine")


def format_table(records: list[dict[str, Any]]) -> str:
    """Methods as rows; memory and time also as ratios to the first method listed."""
    if not records:
        return "(no results)"
    first = records[0]
    adapters = f"LoRA r{first['rank']}, " if first.get("lora") else "all weights trained, "
    head = (f"model {first['model']} ({first.get('layers', '?')} blocks, {adapters}"
            f"{first.get('trainable_params', 0):,} trainable), seq {first['seq']}, batch {first['batch']}, "
            f"{first.get('dtype', '')}, {first['backend']}, "
            + (f"base {first['base']}, " if first.get("base") else "")
            + (f"BLAS: {first['blas']}, " if first.get("blas") else "")
            + f"{first.get('torch_threads', '?')} threads"
            + (" (auto: the cores other processes left free)" if first.get("threads_choice") == "auto" else "") + "\n"
            + f"peak = training memory above the pre-step baseline (weights excluded); footprint = what the "
            f"process holds above the framework's runtime (weights included) plus that peak; estimate = "
            f"edgetrain's analytic step memory (edgetrain/training/step_estimates.py), probe/est its ratio to the peak\n"
            f"s/floor = the step time over its compute floor: its matrix products timed alone at this machine's "
            f"rate (edgetrain/profiler/compute_floor.py)\n"
            f"probe: {first.get('probe', '-')} (OS/allocator), tensors: live tensor storages; "
            f"ratios are to {first['method']}"
            + _gradient_reference_line(records))
    load_changed = load_changed_under(records)
    if load_changed:
        head += "\n" + load_changed
    columns = ["method", "probe MiB", "ratio", "tensors MiB", "ratio", "footprint MiB", "ratio", "estimate MiB",
               "probe/est", "s/step", "ratio", "s/floor", "loss", "grad cos vs ref", "max rel err vs ref", "peak in"]
    rows = [columns]
    for record in records:
        rows.append([
            record["method"],
            _mib(record["peak_bytes_probe"]), _ratio(record["peak_bytes_probe"], first["peak_bytes_probe"]),
            _mib(record["peak_bytes_tensors"]), _ratio(record["peak_bytes_tensors"], first["peak_bytes_tensors"]),
            _mib(record.get("footprint_bytes")), _ratio(record.get("footprint_bytes"), first.get("footprint_bytes")),
            _mib(record.get("estimate_bytes")), _ratio(record["peak_bytes_probe"], record.get("estimate_bytes")),
            _num(record["step_seconds"], ".3f"),
            "-" if load_changed else _ratio(record["step_seconds"], first["step_seconds"]),
            _num(record.get("floor_ratio"), ".2f"),
            _num(record["loss"], ".4f"), _num(record["grad_cosine"], ".4f"),
            _num(record["grad_max_rel_err"], ".1e"), str(record.get("peak_region") or "-"),
        ])
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(w) if i in (0, len(columns) - 1) else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    breakdowns = [line for line in map(breakdown_line, records) if line is not None]
    if breakdowns:
        breakdowns.insert(0, "")
    return head + "\n" + "\n".join(lines + breakdowns + trade_lines(records, times_comparable=not load_changed))


# The autograd methods mesp is weighed against under the table, and what each one is.
TRADE_REFERENCES = {"mebp": "autograd with every block checkpointed", "bp": "plain autograd"}


def trade_lines(records: list[dict[str, Any]], times_comparable: bool = True) -> list[str]:
    """Two lines under the table: what mesp costs against the autograd methods in the run (memory and time as
    ratios, and how exact its gradient was), and what those methods are. [] without mesp or a reference."""
    by_method = {record["method"]: record for record in records}
    mesp = by_method.get("mesp")
    references = [name for name in TRADE_REFERENCES if name in by_method]
    if mesp is None or not references:
        return []

    def ratios(field: str) -> str:
        parts = [f"{_ratio(mesp.get(field), by_method[name].get(field))} {name}'s" for name in references]
        return " and ".join(parts)

    exact = (f"gradients within {mesp['grad_max_rel_err']:.1e} of the fp64 reference, "
             if mesp.get("grad_max_rel_err") is not None else "")
    time = (f"at {ratios('step_seconds')} step time" if times_comparable
            else "(no time ratio: the load changed under the run)")
    first = f"mesp: {exact}in {ratios('peak_bytes_probe')} training memory (peak above the weights), {time}."
    second = ("; ".join(f"{name} is {TRADE_REFERENCES[name]}" for name in references)
              + "; mesp keeps only each block's input and differentiates the blocks by hand, one at a time.")
    return ["", first, second]


def write_json(records: list[dict[str, Any]], path: str | Path) -> Path:
    for record in records:
        missing = [f for f in RECORD_FIELDS if f not in record]
        if missing:
            raise EdgetrainError(f"profile record for {record.get('method')!r} lacks {missing}")
    return atomic_write_bytes(json.dumps(records, indent=2).encode(), path)


def write_plot(records: list[dict[str, Any]], path: str | Path) -> Path:
    """Bar chart: peak memory (probe and tensor accounting) and seconds per step, side by side."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EdgetrainError("--plot needs matplotlib: pip install 'edgetrain[plot]'") from None
    methods = [r["method"] for r in records]
    figure, (memory_axis, time_axis) = plt.subplots(1, 2, figsize=(10, 4))
    positions = range(len(methods))
    width = 0.4
    probe_mib = [(r["peak_bytes_probe"] or 0) / MIB for r in records]
    tensor_mib = [(r["peak_bytes_tensors"] or 0) / MIB for r in records]
    memory_axis.bar([p - width / 2 for p in positions], probe_mib, width, label=f"probe ({records[0].get('probe')})")
    memory_axis.bar([p + width / 2 for p in positions], tensor_mib, width, label="tensor accounting")
    memory_axis.set_xticks(list(positions), methods)
    memory_axis.set_ylabel("peak above baseline (MiB)")
    memory_axis.set_title("training memory per step")
    memory_axis.legend()
    time_axis.bar(list(positions), [r["step_seconds"] for r in records], color="tab:green")
    time_axis.set_xticks(list(positions), methods)
    time_axis.set_ylabel("seconds per step")
    time_axis.set_title("step time")
    first = records[0]
    figure.suptitle(f"{first['model']}  seq {first['seq']}  batch {first['batch']}  rank {first['rank']}  "
                    f"{first['backend']}")
    figure.tight_layout()
    path = Path(path)
    # Rendered in memory, then written atomically: a failed or killed save keeps the previous chart.
    image = io.BytesIO()
    try:
        figure.savefig(image, dpi=110, format=path.suffix.lstrip(".").lower() or "png")
    finally:
        plt.close(figure)
    return atomic_write_bytes(image.getvalue(), path)
