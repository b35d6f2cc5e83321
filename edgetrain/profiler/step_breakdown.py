"""Where a step's time goes beyond its compute floor: the products as they ran inside the step, the other torch
operators, the packed base's tile dequantisation, and what is left between them (Python and dispatch).

`s/floor` (edgetrain/profiler/compute_floor.py) divides a step by its matrix products timed alone, each shape on
its own operands, back to back. Inside a step the same products run slower (operands come cold from the
dequantised tile or the previous operator, two threads start and stop around every call) and the step does more
than products (norms, softmax, RoPE, the activation's derivative). One step is run under a dispatch mode that
times every torch operator call by itself (the mode's own bookkeeping is outside each timing), and the compiled
tile kernel's calls, so that

    step = products in the step + other operators + dequantising tiles + the rest (Python, dispatch, waits)

and each part can be read against the floor. A step's products in the step over the floor is what no Python or
fusion of the other work can go below. The dispatcher's own cost of each call (an alias timed the same way:
dispatch_seconds_per_call) is taken out of the operators' parts and left in the rest, so the operators' parts
are their kernels' work; views (view, slice, transpose, ...) then cost next to nothing.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from edgetrain.profiler.compute_floor import _SHAPES

PARTS = ("products_in_step_seconds", "other_operators_seconds", "tile_dequantising_seconds")


def times_operators_on(device: torch.device) -> bool:
    """Whether a call's wall time is its operator's work on `device`: on a CPU; on a GPU a call returns once its
    kernel is queued, so the breakdown is not taken there (the profile's record leaves its fields out)."""
    return torch.device(device).type == "cpu"


class OperatorTimer(TorchDispatchMode):
    """Wall time of every torch operator call inside it, products apart from the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.paused = 0  # inside a timed tile: its operators (the torch dequantisation) belong to the tile

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.paused:
            return func(*args, **(kwargs or {}))
        part = "products_in_step_seconds" if func in _SHAPES else "other_operators_seconds"
        start = time.perf_counter()
        result = func(*args, **(kwargs or {}))
        self.seconds[part] += time.perf_counter() - start
        self.calls[part] += 1
        return result


@contextmanager
def _timed_tiles(timer: OperatorTimer) -> Iterator[None]:
    """Times every tile a packed matrix dequantises (the compiled kernel's fills and the torch path alike)."""
    from edgetrain.models import quantized, tile_kernel

    patched = [(tile_kernel.KernelRows, "fill"), (quantized.PackedMatrix, "_dequantize_packed")]
    originals = [getattr(owner, name) for owner, name in patched]

    def timed(original: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            if timer.paused:  # a fill inside _dequantize_packed: already timed
                return original(*args, **kwargs)
            timer.paused += 1
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                timer.seconds["tile_dequantising_seconds"] += time.perf_counter() - start
                timer.calls["tile_dequantising_seconds"] += 1
                timer.paused -= 1
        return call

    for (owner, name), original in zip(patched, originals):
        setattr(owner, name, timed(original))
    try:
        yield
    finally:
        for (owner, name), original in zip(patched, originals):
            setattr(owner, name, original)


def dispatch_seconds_per_call(repeats: int = 501) -> float:
    """What a timed call costs under the mode when its kernel does nothing (an alias: a view of a scalar): the
    dispatcher's share of every operator's timing, taken out of the parts so that they are the kernels' own."""
    timer = OperatorTimer()
    tensor = torch.zeros(())
    samples = []
    with timer:
        for _ in range(repeats):
            before = timer.seconds["other_operators_seconds"]
            torch.ops.aten.alias.default(tensor)
            samples.append(timer.seconds["other_operators_seconds"] - before)
    return statistics.median(samples)


def measure_step_breakdown(run_step: Callable[[], Any], step_seconds: float,
                           floor_seconds: float | None) -> dict[str, Any]:
    """Run `run_step` once with every operator and tile timed; the profile's record fields: each part in seconds
    and over the floor, and the rest (`step_seconds` less the parts, as an untimed step spends it). Each operator
    call's dispatch (dispatch_seconds_per_call) is counted in the rest, not in its part."""
    timer = OperatorTimer()
    with _timed_tiles(timer), timer:
        run_step()
    per_call = dispatch_seconds_per_call()
    record: dict[str, Any] = {}
    for part in PARTS:
        calls = timer.calls.get(part, 0) if part != "tile_dequantising_seconds" else 0
        record[part] = max(0.0, timer.seconds.get(part, 0.0) - calls * per_call)
    record["operator_calls"] = timer.calls.get("products_in_step_seconds", 0) + timer.calls.get(
        "other_operators_seconds", 0)
    record["tile_calls"] = timer.calls.get("tile_dequantising_seconds", 0)
    record["dispatch_seconds_per_call"] = per_call
    record["between_operators_seconds"] = max(0.0, step_seconds - sum(record[part] for part in PARTS))
    for part in (*PARTS, "between_operators_seconds"):
        ratio = part.replace("_seconds", "_floor_ratio")
        record[ratio] = record[part] / floor_seconds if floor_seconds else None
    return record


def breakdown_line(record: dict[str, Any]) -> str | None:
    """`s/floor 2.20 = products in the step 1.30 + other operators 0.31 + ...` for one profiled method, or None
    where the record has no breakdown."""
    if record.get("floor_ratio") is None or record.get("products_in_step_floor_ratio") is None:
        return None
    parts = [("products in the step", "products_in_step_floor_ratio"),
             ("other torch operators", "other_operators_floor_ratio"),
             ("dequantising tiles", "tile_dequantising_floor_ratio"),
             ("Python and dispatch", "between_operators_floor_ratio")]
    shown = " + ".join(f"{label} {record[field]:.2f}" for label, field in parts if record.get(field))
    return f"{record['method']}: s/floor {record['floor_ratio']:.2f} = {shown} (edgetrain/profiler/step_breakdown.py)"
