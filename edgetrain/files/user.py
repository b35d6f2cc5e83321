"""Reading the files a user hands edgetrain (model directories, adapters, configs) without trusting them.

Only regular files are opened: a FIFO, socket or device named like `config.json` or `model.safetensors`
would block the reader forever or stream without end. JSON is bounded in size, in nesting depth and to
finite numbers (Python's reader accepts `NaN`, `Infinity` and `1e999`, which no config means).
Symbolic links are followed: the Hugging Face cache links every snapshot file to a blob.
"""
from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from edgetrain.registry import EdgetrainError

# A config or shard index is a few KiB; a damaged or hostile one could be any size.
MAX_JSON_BYTES = 64 << 20

_FILE_KINDS = [(stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
               (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device")]


def _not_regular(path: Path, mode: int, error: type[EdgetrainError], what: str) -> EdgetrainError:
    kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
    return error(f"{path}: {what} is {kind}, not a regular file")


def require_regular_file(path: str | Path, error: type[EdgetrainError], what: str) -> Path:
    """`path` if it is (or links to) a regular file; else `error` naming the path and what it is."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise error(f"{path}: {what} does not exist") from None
    except OSError as exc:  # a link loop, a name too long, no permission on a parent
        raise error(f"{path}: cannot read {what} ({exc.strerror or exc})") from None
    if not stat.S_ISREG(mode):
        raise _not_regular(path, mode, error, what)
    return path


def open_regular_file(path: str | Path, error: type[EdgetrainError], what: str,
                      missing: str = "does not exist") -> int:
    """A read-only descriptor of `path` if it is (or links to) a regular file; else `error` naming the path and
    what it is (`missing` says what a missing file means). The kind is checked before the open (a FIFO would
    block it, a device stream without end) and again on the descriptor: the name can be swapped in between."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISREG(mode):
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
            mode = os.fstat(fd).st_mode
            if stat.S_ISREG(mode):
                return fd
            os.close(fd)
    except FileNotFoundError:
        raise error(f"{path}: {what} {missing}") from None
    except (OSError, ValueError) as exc:  # a link loop, no permission, a NUL byte in the name
        raise error(f"{path}: cannot read {what} ({getattr(exc, 'strerror', None) or exc})") from None
    raise _not_regular(path, mode, error, what)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"the non-standard constant {name} (JSON has no NaN or infinity)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text} overflows a float")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Python's reader keeps the last of two equal keys; which one another reader keeps is anyone's guess.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"the key {key!r} appears twice in one object")
        result[key] = value
    return result


def parse_json(text: str | bytes, error: type[EdgetrainError], where: str, unique_keys: bool = False) -> Any:
    """Strict JSON: finite numbers only (and, with `unique_keys`, no key twice in an object); nesting too deep
    for the parser is an `error`, not a crash."""
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float,
                          object_pairs_hook=_unique_keys if unique_keys else None)
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError; so are the hooks'
        raise error(f"{where}: not valid JSON ({exc})") from None


def read_json_object(path: str | Path, error: type[EdgetrainError], what: str) -> dict[str, Any]:
    """The JSON object in `path` (a regular file of at most MAX_JSON_BYTES)."""
    path = require_regular_file(path, error, what)
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_JSON_BYTES + 1)
    except OSError as exc:
        raise error(f"{path}: cannot read {what} ({exc.strerror or exc})") from None
    if len(data) > MAX_JSON_BYTES:
        raise error(f"{path}: {what} is larger than {MAX_JSON_BYTES >> 20} MiB; not a config")
    raw = parse_json(data, error, f"{path} ({what})")
    if not isinstance(raw, dict):
        raise error(f"{path}: {what} must hold a JSON object, not {type(raw).__name__}")
    return raw
