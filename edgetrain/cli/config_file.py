"""`--config run.toml`: a subcommand's flags written as a TOML table, e.g.

    model = "tiny"
    method = "mesp"
    steps = 200
    checkpoint-dir = "ckpt"      # or checkpoint_dir
    files = ["notes/", "more.txt"]
    quiet = true

Each key is a flag of the subcommand (without the dashes); flags given on the command line win. Every key
and value is checked as the flag would check it, before any work: an unknown key, a value of the wrong kind
or outside the flag's choices is an EdgetrainError naming the file and the key.
"""
from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any

from edgetrain.files.user import require_regular_file
from edgetrain.registry import EdgetrainError

# A run file is a few lines; anything larger is not one.
MAX_CONFIG_BYTES = 1 << 20


def _flag_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {action.dest: action for action in parser._actions  # argparse keeps no public list
            if action.option_strings and action.dest not in ("help", "config")}


def _scalar(value: Any, action: argparse.Action, where: str) -> Any:
    if isinstance(value, (dict, list)) or isinstance(value, bool):
        raise EdgetrainError(f"{where}: expected one value for --{action.dest.replace('_', '-')}, got {value!r}")
    if action.type is not None:
        try:
            value = action.type(str(value) if not isinstance(value, str) else value)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            raise EdgetrainError(f"{where}: {value!r} is not a valid value ({exc})") from None
    elif not isinstance(value, str):
        value = str(value)
    if action.choices is not None and value not in action.choices:
        raise EdgetrainError(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return value


def read_config(path: str | Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The flag values (by argparse dest) a TOML run file sets for the subcommand `parser`."""
    path = require_regular_file(path, EdgetrainError, "the --config run file")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise EdgetrainError(f"--config {path}: {path.stat().st_size:,} bytes is not a run file (at most 1 MiB)")
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise EdgetrainError(f"--config {path}: not valid TOML ({exc})") from None
    actions = _flag_actions(parser)
    values: dict[str, Any] = {}
    for key, value in table.items():
        dest = key.replace("-", "_")
        where = f"--config {path}: {key}"
        if dest not in actions:
            known = ", ".join(sorted(name.replace("_", "-") for name in actions))
            raise EdgetrainError(f"--config {path}: unknown key {key!r}; the flags of this command are: {known}")
        action = actions[dest]
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if not isinstance(value, bool):
                raise EdgetrainError(f"{where}: expected true or false, got {value!r}")
        elif isinstance(action, argparse._AppendAction) or action.nargs in ("*", "+"):
            items = value if isinstance(value, list) else [value]
            if action.nargs == "+" and not items:
                raise EdgetrainError(f"{where}: needs at least one value")
            value = [_scalar(item, action, where) for item in items]
        else:
            value = _scalar(value, action, where)
        values[dest] = value
    return values


def apply_config(parser: argparse.ArgumentParser, command: argparse.ArgumentParser, argv: list[str],
                 values: dict[str, Any]) -> argparse.Namespace:
    """Parse `argv` again with `parser`, the file's values the defaults of the subcommand parser `command`,
    so that flags on the command line win."""
    actions = _flag_actions(command)
    for dest in values:
        actions[dest].required = False  # given by the file
    command.set_defaults(**values)
    return parser.parse_args(argv)
