"""Memory sizes as users write them: 512 * 2**20, "512MiB", "1.5 GB"."""
from __future__ import annotations

from edgetrain.registry import EdgetrainError

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}

# An exabyte: no device holds more; a larger size is a typo or a hostile value, not a budget.
_MAX_BYTES = 2 ** 60


def parse_bytes(value: int | str) -> int:
    """512 * 2**20, "512MiB", "1.5 GB" -> bytes (positive, finite, at most 2**60)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        amount = value
    else:
        text = str(value).strip().lower().replace(" ", "")
        number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(number):] or "b"
        try:
            amount = float(number) * _UNITS[unit]
        except (KeyError, ValueError):
            raise EdgetrainError(f"cannot read memory size {value!r}; use bytes or e.g. '512MiB', '2GB'") from None
    if not 0 < amount <= _MAX_BYTES:  # also false for NaN
        raise EdgetrainError(f"memory size {value!r} must be a positive number of bytes up to 2**60")
    return int(amount)
