"""How `edgetrain <command> --help` lays out a description: prose wrapped, examples kept as written.

argparse's default formatter joins every line of a description into one paragraph, so the example commands
of a module's docstring ran together into the prose around them. Here a description is read as paragraphs
(blank lines between them); in each, lines that start with whitespace (an example, a table row) are printed
verbatim, and the runs of plain lines between them are wrapped to the terminal as before.
"""
from __future__ import annotations

import argparse
import re
import textwrap


class ExampleKeepingFormatter(argparse.HelpFormatter):
    """argparse's formatter, except that descriptions and epilogs keep their indented lines and paragraph breaks."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = re.split(r"\n[ \t]*\n", textwrap.dedent(text).strip("\n"))
        return "\n\n".join(_fill_paragraph(paragraph, width, indent) for paragraph in paragraphs)


def _fill_paragraph(paragraph: str, width: int, indent: str) -> str:
    out: list[str] = []
    prose: list[str] = []
    for line in paragraph.splitlines():
        if line[:1].isspace():  # an example or table row: as written, or it is no longer a command to copy
            out += _wrapped(prose, width, indent)
            prose = []
            out.append(indent + line.rstrip())
        elif line.strip():
            prose.append(line.strip())
    out += _wrapped(prose, width, indent)
    return "\n".join(out)


def _wrapped(prose: list[str], width: int, indent: str) -> list[str]:
    if not prose:
        return []
    return textwrap.wrap(" ".join(prose), width, initial_indent=indent, subsequent_indent=indent)


class CliParser(argparse.ArgumentParser):
    """An ArgumentParser whose help uses ExampleKeepingFormatter unless told otherwise. Subparsers are made with the
    parser's own class (argparse's add_subparsers default), so every command and sub-command below one gets it."""

    def __init__(self, *args, formatter_class: type[argparse.HelpFormatter] = ExampleKeepingFormatter,
                 **kwargs) -> None:
        super().__init__(*args, formatter_class=formatter_class, **kwargs)
