"""The memory-budget guard's refusal: what the first step was measured to add, the methods ranked by the
memory their step adds (measured where they ran, estimated from the model's shape where they did not),
and what to try instead.

A method is ranked by what its step adds above the weights, never by weights + step: the weights are
the same for every method, and a figure that mixed in memory-mapped weights paged in by the first
forward could rank a method below one whose step adds a tenth of its own.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

MIB = 2**20


def _mib(value: int) -> str:
    return f"{value / MIB:,.1f} MiB"


@dataclass(frozen=True)
class StepFigure:
    """The memory one method's step adds on the first batch: measured (on the whole batch, or on a slice
    of it that was already over the budget -- then a lower bound) or estimated."""

    method: str
    step_bytes: int
    measured: bool
    slice_tokens: int | None = None  # measured on this many of the batch's tokens (a lower bound)
    batch_tokens: int | None = None
    estimate_bytes: int | None = None  # for a lower bound: the whole batch's estimate, when larger

    @property
    def lower_bound(self) -> bool:
        return self.slice_tokens is not None

    def describe(self) -> str:
        """One entry of what was tried: 'bp: over 12.0 MiB (measured on 64 of the batch's 512 tokens)'."""
        if self.lower_bound:
            return (f"{self.method}: over {_mib(self.step_bytes)} (measured on {self.slice_tokens} of the batch's "
                    f"{self.batch_tokens} tokens)")
        return f"{self.method}: {_mib(self.step_bytes)}"

    def ranked_entry(self) -> str:
        """One entry of the ranking: 'mesp ~26.3 MiB (estimated)', 'bp over 12.0 MiB (measured)'."""
        if not self.measured:
            return f"{self.method} ~{_mib(self.step_bytes)} (estimated)"
        if not self.lower_bound:
            return f"{self.method} {_mib(self.step_bytes)} (measured)"
        entry = f"{self.method} over {_mib(self.step_bytes)} (measured on a slice"
        return entry + (f", ~{_mib(self.estimate_bytes)} estimated)" if self.estimate_bytes is not None else ")")


def rank_methods(tried: Iterable[StepFigure], estimates: dict[str, int | None]) -> list[StepFigure]:
    """The tried methods and the estimated others, least step memory first. A slice's lower bound is
    ranked by the larger of it and the method's estimate; methods with no figure are left out."""
    figures = {}
    for figure in tried:
        estimate = estimates.get(figure.method)
        if figure.lower_bound and estimate is not None and estimate > figure.step_bytes:
            figure = replace(figure, estimate_bytes=estimate)
        figures[figure.method] = figure
    for method, estimate in estimates.items():
        if method not in figures and estimate is not None:
            figures[method] = StepFigure(method, estimate, measured=False)

    def key(figure: StepFigure) -> int:
        return max(figure.step_bytes, figure.estimate_bytes or 0)

    return sorted(figures.values(), key=key)


def lower_memory_methods(tried: list[StepFigure], ranked: list[StepFigure], fallback_order: Iterable[str],
                         registered: Iterable[str]) -> list[str]:
    """Methods not tried yet that should need less: those ranked before every tried method, least first;
    without estimates (a model they do not cover), the untried ones of `fallback_order`."""
    done = {figure.method for figure in tried}
    available = set(registered)
    estimated = [figure for figure in ranked if not figure.measured]
    if not estimated:
        return [m for m in fallback_order if m in available and m not in done]
    lower = []
    for figure in ranked:
        if figure.measured:
            break  # everything after the first tried method is ranked above it
        if figure.method in available:
            lower.append(figure.method)
    return lower


def refusal_message(tried: list[StepFigure], ranked: list[StepFigure], *, weights_bytes: int, budget_bytes: int,
                    budget_origin: str, probe_name: str, suggestions: list[str]) -> str:
    """The MemoryBudgetError text: the budget, the weights and what is left beside them, what each tried
    method's step adds, the ranking, and what to try."""
    left = max(0, budget_bytes - weights_bytes)
    text = (f"the first step is over the memory budget of {_mib(budget_bytes)}{budget_origin}, which leaves "
            f"{_mib(left)} beside the weights ({_mib(weights_bytes)}) for what a step adds; measured by the "
            f"{probe_name} probe, it adds {'; '.join(figure.describe() for figure in tried)}.")
    if len(ranked) > 1:
        text += (" Methods by the memory their step adds on this batch: "
                 + " < ".join(figure.ranked_entry() for figure in ranked) + ".")
    return text + " Try " + ", or ".join(suggestions or ["a smaller model"])
