"""On-device personalisation an app embeds: a durable example store, a training policy, gated promotion of
adapter versions, forget and rollback (edgetrain.personalise.personaliser has the overview; docs/personalise.md
the quick start).

The store, the examples, the policy and the sensors import without torch, so a process that only adds
examples (`Store(path).add(...)`) starts quickly; the Personaliser (and what trains) loads on first use.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from edgetrain.personalise.errors import (BadExampleError, DamagedStoreError, ModelMismatchError,
                                          NothingToRollBackError, PersonaliseError, StoreBusyError, StoreError,
                                          StoreVersionError, WrongKindError)
from edgetrain.personalise.events import EventLog, read_events
from edgetrain.personalise.examples import Example, is_held_out, parse_example
from edgetrain.personalise.policy import Decision, Policy
from edgetrain.personalise.sensors import FixedSensors, Readings, SystemSensors
from edgetrain.personalise.store import Store
from edgetrain.utils.lazy import lazy_exports

_LAZY = {"Personaliser": "edgetrain.personalise.personaliser", "RunResult": "edgetrain.personalise.personaliser"}

if TYPE_CHECKING:
    from edgetrain.personalise.personaliser import Personaliser, RunResult


__getattr__ = lazy_exports(__name__, _LAZY, globals())

__all__ = ["BadExampleError", "DamagedStoreError", "Decision", "EventLog", "Example", "FixedSensors",
           "ModelMismatchError", "NothingToRollBackError", "PersonaliseError", "Personaliser", "Policy", "Readings",
           "RunResult", "Store", "StoreBusyError", "StoreError", "StoreVersionError", "SystemSensors",
           "WrongKindError", "is_held_out", "parse_example", "read_events"]
