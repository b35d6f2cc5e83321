"""Validation of method options, shared by the torch and MLX implementations of a method."""
from __future__ import annotations

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
