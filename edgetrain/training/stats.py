"""StepStats: what one step of the Learner did and cost (its own module, so that the parts of the learner
that report steps need not import the learner)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepStats:
    """What one step did and cost.

    peak_bytes: the memory the step added, read by `probe` (None without one): its peak during the step
    minus its reading just before, with the allocator's free heap given back to the kernel and its large
    free chunks plugged for the step (so a step cannot be served, unseen, from memory that is already
    resident), less the file-backed pages the step mapped in (memory-mapped weights read for the first
    time, library code), which are not step memory. The weights and whatever the process held before are
    not in it. So the same step reads the same in a long-lived process as in a fresh one after a warm-up
    step (within 1 MiB + 5%, tests/test_step_memory.py); the first step of a process adds its one-time
    allocations (thread pools, kernel caches). edgetrain/training/step_memory.py has the details.
    """

    step: int               # steps completed after this one
    loss: float
    samples: int
    tokens: int
    seconds: float
    peak_bytes: int | None  # the memory the step added (see above); None if no probe
    probe: str
    lr: float | None = None  # the learning rate this step used (the schedule's rate at this step)
    threads: int | None = None  # the intra-op threads it ran on, where the learner set them (threads=)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")
