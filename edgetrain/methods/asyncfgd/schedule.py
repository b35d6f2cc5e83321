"""One timestamp of AsyncFGD (Algorithm 1), and the deterministic single-thread scheduler of it.

At timestamp t module k works on the sample that entered at t-k (Eq. 6-7), with its own current
weights, and passes (activation, JVPs) on to module k+1 for the next timestamp; the last module
yields the loss and directional derivative of the sample that entered at t-K+1, which is broadcast
(line 7) and every module updates its weights with the tangent it drew for that sample (lines 8-10).

Staleness, worked out. Write w^v for the weights after v updates; the update at timestamp t makes
w^{t-K+2} (Eq. 8), so during timestamp t the weights are w^{t-K+1}. Sample s reaches module k at
timestamp s+k and meets w_G(k)^{s+k-K+1}; its update happens at t = s+K-1, where s+k-K+1 =
t-2K+k+2: exactly the weights of Eq. 6 and of the proof of Lemma 5.6 (w^{t'-K+k+1}, t' = t-K+1).
Module k is therefore K-1-k updates stale for the sample it updates with and the last module is up
to date (g(k) = K-1-k, §4.1) -- with one copy of the weights per module, no weight history.
Before the pipeline is full (t < K-1) the missing inputs are zeros (Eq. 9): those modules idle and
no update is made, since the step sizes of Algorithm 1 start at t = K-1.

A sample whose loss or directional derivative is not finite updates no module; it still leaves the
pipeline (the method raises NonFiniteError after the timestamp), so one bad sample cannot block it.
The same holds when its update would write a non-finite weight anywhere (a finite step can overflow
float16): with plain SGD every module first checks its update (`ForwardStage.check_update`, nothing
written), and only when all modules' checks pass does any module write.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from edgetrain.methods.base import NonFiniteError
from edgetrain.methods.fgd import ForwardStage, check_updates


@dataclass
class InFlight:
    """What module k hands to module k+1: a sample's activation and its JVP per tangent."""

    sample: int  # the timestamp at which the sample entered module 0
    activation: torch.Tensor
    jvps: list[torch.Tensor | None]
    targets: torch.Tensor
    ready: Any = None  # CUDA event recorded after the producing stream wrote it (cuda-streams runtime)


@dataclass
class Finished:
    """The sample leaving the last module: its loss and directional derivatives (broadcast to all)."""

    sample: int
    loss: torch.Tensor
    derivatives: list[float]

    @property
    def finite(self) -> bool:
        return all(map(_finite, [float(self.loss), *self.derivatives]))


@dataclass
class TimestampOutcome:
    in_flight: list[InFlight | None]  # K-1 entries: module k's output, waiting for module k+1
    finished: Finished | None
    refused: NonFiniteError | None = None  # why the finished sample's update was not made (none was)


def forward_stage(stage: ForwardStage, incoming: InFlight | None) -> InFlight | Finished | None:
    """Lines 3-5 of Algorithm 1 for one module (and the loss, for the last)."""
    if incoming is None:
        return None
    h, jvps = stage.forward(incoming.sample, incoming.activation, incoming.jvps)
    if not stage.is_last:
        return InFlight(incoming.sample, h, jvps, incoming.targets)
    loss, derivatives = stage.loss_derivatives(h, jvps, incoming.targets)
    return Finished(incoming.sample, loss, derivatives)


def non_finite_error(finished: Finished) -> NonFiniteError:
    return NonFiniteError(f"non-finite loss or directional derivative ({float(finished.loss)}, "
                          f"{finished.derivatives}) for the sample that entered at step {finished.sample}; "
                          "no module was updated with it and it left the pipeline")


def update_stage(stage: ForwardStage, finished: Finished, learning_rates: dict[int, float] | None) -> None:
    """Lines 9-10 for one module: in place with plain SGD, else the estimate goes to .grad."""
    if learning_rates is not None:
        stage.update_in_place(finished.sample, finished.derivatives, learning_rates)
    else:
        stage.set_gradients(finished.sample, finished.derivatives)


def _finite(value: float) -> bool:
    return value == value and abs(value) != float("inf")


class ReferenceScheduler:
    """Algorithm 1 in this thread, one module after another: deterministic, the oracle the parallel
    runtimes are tested against. Modules read only what the previous timestamp left, so running
    them in sequence computes exactly what K concurrent workers compute."""

    name = "reference"

    def __init__(self, stages: Sequence[ForwardStage]) -> None:
        self.stages = list(stages)

    def run(self, inputs: Sequence[InFlight | None], learning_rates: dict[int, float] | None) -> TimestampOutcome:
        results = [forward_stage(stage, incoming) for stage, incoming in zip(self.stages, inputs)]
        finished, refused = results[-1], None
        if finished is not None and finished.finite:
            if learning_rates is not None:
                refused = check_updates(self.stages, finished.sample, finished.derivatives, learning_rates)
            if refused is None:
                for stage in self.stages:
                    update_stage(stage, finished, learning_rates)
        return TimestampOutcome(list(results[:-1]), finished, refused)

    def close(self) -> None:
        pass
