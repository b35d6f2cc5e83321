"""Validation of method options, shared by the torch and MLX implementations of a method."""
from __future__ import annotations

import math
from typing import Any

from edgetrain.registry import EdgetrainError


def positive_int_option(method: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EdgetrainError(f"{method}: {name} must be a positive integer, got {value!r}")
    return value


def flag_option(method: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise EdgetrainError(f"{method}: {name} must be True or False, got {value!r}")
    return value


def positive_number_option(method: str, name: str, value: Any) -> float:
    """A finite number > 0 (an int or a float; not a bool, a string or None)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EdgetrainError(f"{method}: {name} must be a finite positive number, got {value!r} "
                             f"({type(value).__name__})")
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise EdgetrainError(f"{method}: {name} must be a finite positive number, got {value!r}")
    return number


def int_option(method: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise EdgetrainError(f"{method}: {name} must be an integer, got {value!r}")
    return value
