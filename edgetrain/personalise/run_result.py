"""RunResult: what one Personaliser.run() did (its own module: the runner makes it, the windows fill it in)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunResult:
    """What one run() did: steps taken, windows that reached the gate, versions promoted, and why it ended
    ("stop", "max_steps", "max_seconds", "policy", "paused", "waiting")."""

    steps: int = 0
    windows: int = 0
    promoted: list[int] = field(default_factory=list)
    rejected: int = 0
    reason: str = ""
