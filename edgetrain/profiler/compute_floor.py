"""A step's compute floor: how long its matrix products take alone, at this machine's own rate.

The products a step runs are recorded once (a torch dispatch mode sees every mm, addmm, bmm and baddbmm,
whatever called them: autograd, MeSP's hand-written backward, a packed base's dequantised tiles), then
each distinct shape is timed by itself, `repeats` times, on fresh operands. The floor is the sum over
shapes of count x median time. `step_seconds / floor_seconds` is then how far a method's step is from the
products it cannot avoid; everything else (elementwise kernels, dequantisation, Python, waits) is the gap.
FLOPs are 2 x M x K x N per product (a multiply and an add), as GEMM rates are quoted.
"""
from __future__ import annotations

import statistics
import time
from collections import Counter
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten op -> the (batch, M, K, N) of one call from its arguments. Every overload a step may use: MeSP and the
# packed tiles write into buffers (mm.out, addmm_), autograd allocates (mm, addmm).
_aten = torch.ops.aten


def _product(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, int, int]:
    return (1, a.shape[0], a.shape[1], b.shape[1]) if a.dim() == 2 else (a.shape[0], a.shape[1], a.shape[2],
                                                                         b.shape[2])


_PLAIN = [_aten.mm.default, _aten.mm.out, _aten.bmm.default, _aten.bmm.out]
_WITH_INPUT = [_aten.addmm.default, _aten.addmm.out, _aten.addmm_.default, _aten.baddbmm.default,
               _aten.baddbmm.out, _aten.baddbmm_.default]
_SHAPES: dict[Any, Callable[..., tuple[int, int, int, int]]] = {
    **{op: (lambda a, b, *rest: _product(a, b)) for op in _PLAIN},
    **{op: (lambda bias, a, b, *rest: _product(a, b)) for op in _WITH_INPUT}}


class ProductRecorder(TorchDispatchMode):
    """Counts the matrix products run inside it by (dtype, device, batch, M, K, N)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        shape = _SHAPES.get(func)
        if shape is not None:
            operand = args[1] if func in _WITH_INPUT else args[0]
            self.counts[(operand.dtype, str(operand.device), *shape(*args))] += 1
        return func(*args, **(kwargs or {}))


def product_flops(counts: Counter) -> int:
    return sum(2 * batch * m * k * n * count for (_, _, batch, m, k, n), count in counts.items())


def floor_seconds(counts: Counter, repeats: int = 5) -> float:
    """Sum over the recorded shapes of count x the median time of that product alone (after a warm-up)."""
    total = 0.0
    for (dtype, device, batch, m, k, n), count in counts.items():
        left = torch.randn(batch, m, k, dtype=dtype, device=device)
        right = torch.randn(batch, k, n, dtype=dtype, device=device)
        out = torch.empty(batch, m, n, dtype=dtype, device=device)
        torch.bmm(left, right, out=out)
        times = []
        for _ in range(repeats):
            _synchronize(device)
            start = time.perf_counter()
            torch.bmm(left, right, out=out)
            _synchronize(device)
            times.append(time.perf_counter() - start)
        total += count * statistics.median(times)
    return total


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def measure_compute_floor(run_step: Callable[[], Any], step_seconds: float, repeats: int = 5) -> dict[str, Any]:
    """Record one call of `run_step` (a training step), time its products alone; the profile's record fields."""
    with ProductRecorder() as recorder:
        run_step()
    floor = floor_seconds(recorder.counts, repeats)
    flops = product_flops(recorder.counts)
    return {"matmul_flops": flops, "matmul_calls": sum(recorder.counts.values()),
            "floor_seconds": floor, "gemm_rate_flops": flops / floor if floor > 0 else None,
            "floor_ratio": step_seconds / floor if floor > 0 else None}
