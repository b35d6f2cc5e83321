"""Every adversarial case of tests/reliability is counted by fault class and outcome, and the counts print
at the end of the run (conftest.py), so a run says how many hostile cases it tried and that none was
unhandled or silently wrong. Outcomes:
  refused         a named EdgetrainError (the promise for anything damaged or hostile);
  accepted        the input was usable and the result was checked to be right;
  unhandled       any other exception: the test fails with it;
  silently wrong  no error, but the result or the state is not what the input says: the test fails.
"""
from __future__ import annotations

import os
from collections import Counter
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from edgetrain.registry import EdgetrainError

# The fault classes of issue 20, the process killed or a save failing part-way, (issue 40) files read as
# text that are not text, and (issue 53) a full disk, the native runner's files and flags, and the MLX
# exported functions (docs/reliability.md has one row each).
CLASSES = ("checkpoint metadata", "non-finite numbers", "hostile model files", "adapters", "batches",
           "resources and paths", "resume semantics", "kills and crashes", "text inputs", "full disk",
           "native runner", "MLX functions")
FAILURES = ("unhandled", "silently wrong")
# The long fuzz run (test_long_fuzz.py, marked slow) sets this to draw several times more examples.
FUZZ_SCALE_VARIABLE = "EDGETRAIN_FUZZ_SCALE"
COUNTS: Counter[tuple[str, str]] = Counter()


def fuzz_settings(max_examples: int) -> Any:
    """hypothesis settings for a fuzz test: `max_examples` in the default run, times $EDGETRAIN_FUZZ_SCALE in
    the long one (test_long_fuzz.py: 3); no deadline (a first example pays for imports and model builds)."""
    from hypothesis import HealthCheck, settings

    scale = int(os.environ.get(FUZZ_SCALE_VARIABLE, "1"))
    return settings(max_examples=max_examples * scale, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def attempt(fault_class: str, action: Callable[[], Any], sound: Callable[[Any], bool] | None = None) -> Any:
    """Run `action`; return the EdgetrainError it raised, or its result when `sound(result)` holds."""
    assert fault_class in CLASSES, fault_class
    try:
        result = action()
    except EdgetrainError as exc:
        COUNTS[fault_class, "refused"] += 1
        return exc
    except Exception:
        COUNTS[fault_class, "unhandled"] += 1
        raise
    if sound is not None and not sound(result):
        COUNTS[fault_class, "silently wrong"] += 1
        raise AssertionError(f"{fault_class}: accepted without an error, but the result is wrong: {result!r}")
    COUNTS[fault_class, "accepted"] += 1
    return result


def record(fault_class: str, outcome: str) -> None:
    """Count an outcome observed elsewhere (in a child process, say)."""
    assert fault_class in CLASSES and outcome in ("refused", "accepted") + FAILURES, (fault_class, outcome)
    COUNTS[fault_class, outcome] += 1


@contextmanager
def checked(fault_class: str) -> Iterator[None]:
    """A case whose checks run inside the block (a kill, then the state compared with the run that was not
    killed): accepted when they hold, silently wrong when an assertion fails, unhandled on any other
    exception."""
    assert fault_class in CLASSES, fault_class
    try:
        yield
    except AssertionError:
        COUNTS[fault_class, "silently wrong"] += 1
        raise
    except Exception:
        COUNTS[fault_class, "unhandled"] += 1
        raise
    COUNTS[fault_class, "accepted"] += 1


def refused(fault_class: str, action: Callable[[], Any], match: str | None = None) -> EdgetrainError:
    """Run `action`, which must raise a named EdgetrainError (whose message contains `match`)."""
    outcome = attempt(fault_class, action, sound=lambda result: False)
    assert isinstance(outcome, EdgetrainError)
    if match is not None:
        assert match in str(outcome), f"{fault_class}: the error does not say {match!r}: {outcome}"
    return outcome


def table() -> list[str]:
    """The counts as text lines, one per fault class that ran."""
    outcomes = ("refused", "accepted") + FAILURES
    lines = [f"{'fault class':<22}" + "".join(f"{o:>16}" for o in outcomes)]
    for fault_class in CLASSES:
        if any(COUNTS[fault_class, o] for o in outcomes):
            lines.append(f"{fault_class:<22}" + "".join(f"{COUNTS[fault_class, o]:>16}" for o in outcomes))
    total = sum(COUNTS.values())
    lines.append(f"{total} adversarial cases; {sum(COUNTS[c, f] for c in CLASSES for f in FAILURES)} "
                 "unhandled or silently wrong")
    return lines
