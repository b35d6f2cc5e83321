"""`--help` reads as written: every command's and sub-command's help keeps its description's example lines whole
and its paragraph breaks (edgetrain/cli/help_format.py), and `python -m edgetrain` is the same command."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from edgetrain.cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]


Command = tuple[tuple[str, ...], argparse.ArgumentParser]


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[Command]:
    """Every parser under `parser` (itself first) with the words that reach it, found by walking its subparsers."""
    found = [(path, parser)]
    for action in parser._actions:
        choices = action.choices
        if isinstance(choices, dict) and all(isinstance(p, argparse.ArgumentParser) for p in choices.values()):
            for name, child in choices.items():
                found += _commands(child, (*path, name))
    return found


COMMANDS = _commands(build_parser())


def _examples(text: str | None) -> list[str]:
    """The example lines of a description: those indented by four spaces or more."""
    return [line.strip() for line in (text or "").splitlines() if line.startswith("    ") and line.strip()]


def _help(path: tuple[str, ...], capsys) -> list[str]:
    with pytest.raises(SystemExit) as done:
        main([*path, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out.splitlines()


def test_the_walk_finds_every_command_and_the_nested_ones():
    paths = {path for path, _ in COMMANDS}
    assert {("personalise", action) for action in ("add", "run", "status", "forget", "rollback")} <= paths
    assert {("export",), ("train",), ("list",)} <= paths
    # Enough examples that the check below cannot pass by finding none.
    assert sum(len(_examples(parser.description)) for _, parser in COMMANDS) >= 10


@pytest.mark.parametrize("columns", ["60", "200"])
@pytest.mark.parametrize("path", [path for path, _ in COMMANDS], ids=lambda path: " ".join(path) or "edgetrain")
def test_help_keeps_each_example_on_one_line_and_the_paragraphs_apart(path, columns, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", columns)  # argparse's width: examples stay whole however narrow the terminal
    parser = dict(COMMANDS)[path]
    lines = _help(path, capsys)
    stripped = [line.strip() for line in lines]
    for text in (parser.description, parser.epilog):
        for example in _examples(text):
            assert example in stripped, f"`edgetrain {' '.join(path)} --help` broke up the line: {example}"
        paragraphs = [p for p in (text or "").split("\n\n") if p.strip()]
        for paragraph in paragraphs[1:]:  # each begins a line right after a blank one
            start = paragraph.strip().splitlines()[0].strip()[:20]
            at = next(i for i, line in enumerate(stripped) if line.startswith(start))
            assert stripped[at - 1] == "", f"no paragraph break before {start!r}"


def test_prose_is_still_wrapped_to_the_terminal(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    lines = _help(("export",), capsys)
    prose = [line for line in lines if line and not line.startswith(" ") and "edgetrain" not in line]
    assert prose and max(map(len, prose)) <= 60


def test_python_m_edgetrain_is_the_command_and_its_help_imports_no_torch():
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "edgetrain", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: edgetrain" in done.stdout and "personalise" in done.stdout
    imported = [line.rpartition("|")[2].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert "edgetrain.cli" in imported
    assert not [name for name in imported if name == "torch" or name.startswith("torch.")]
    version = subprocess.run([sys.executable, "-m", "edgetrain", "--version"], cwd=REPO, capture_output=True,
                             text=True, timeout=120)
    assert version.returncode == 0 and version.stdout.startswith("edgetrain ")
