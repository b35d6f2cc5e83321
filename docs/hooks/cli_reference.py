"""mkdocs hook: docs/cli.md's reference is generated from the argparse parsers at build time.

The page holds two markers that this hook replaces:

    <!-- cli-reference -->        every `edgetrain` subcommand, then the torchrun entry points
    <!-- targets-table -->        the device profiles edgetrain ships (devices.md)

Generating the reference from the parsers themselves means a flag added, renamed or removed in
edgetrain/cli shows up on the next build; a hand-written copy would drift.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os

CLI_MARKER = "<!-- cli-reference -->"
TARGETS_MARKER = "<!-- targets-table -->"

# Server-side programs started with `torchrun ... -m MODULE`; each module has build_parser().
TORCHRUN_ENTRY_POINTS = ("edgetrain.recipes.ddp_segprop", "edgetrain.recipes.scpl_pipeline",
                         "edgetrain.recipes.subnet_dp.run")


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__()
        self.parser = parser


def edgetrain_parser() -> argparse.ArgumentParser:
    """The `edgetrain` parser exactly as the command builds it.

    edgetrain.cli builds its parser inside main(), subcommand by subcommand (SUBCOMMANDS, each module's
    build_parser(), then the --config flag every subcommand takes). Rather than copy those steps here,
    main() runs with parse_known_args intercepted: the first parser it is asked to parse with is the
    finished top-level parser. A module-level build_parser(), if edgetrain.cli gets one, is used instead.
    """
    cli = importlib.import_module("edgetrain.cli")
    if callable(getattr(cli, "build_parser", None)):
        return cli.build_parser()
    original = argparse.ArgumentParser.parse_known_args

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    argparse.ArgumentParser.parse_known_args = capture
    try:
        cli.main(["--help"])
    except _Captured as captured:
        return captured.parser
    finally:
        argparse.ArgumentParser.parse_known_args = original
    raise RuntimeError("edgetrain.cli.main() returned without parsing its arguments")


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices.items())
    return []


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _flags(action: argparse.Action) -> str:
    if action.option_strings:
        metavar = ""
        if action.nargs != 0:
            metavar = action.metavar or action.dest.upper()
            metavar = " " + (" ".join(metavar) if isinstance(metavar, tuple) else metavar)
        return ", ".join(f"`{name}{metavar}`" for name in action.option_strings)
    return f"`{action.metavar or action.dest}` (positional)"


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    text = action.help or ""
    if "%(" in text:  # argparse's own substitutions, e.g. %(default)s
        text = parser._get_formatter()._expand_help(action)
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        text += f" (one of: {', '.join(map(str, action.choices))})"
    if action.required:
        text += " (required)"
    elif (action.option_strings and action.nargs != 0 and action.default not in (None, argparse.SUPPRESS, [])
          and "default" not in text):
        text += f" (default: `{action.default}`)"
    return _cell(text)


def render_parser(title: str, parser: argparse.ArgumentParser, level: int = 2) -> str:
    """One parser as markdown: its description, its usage line and a table of its arguments."""
    lines = [f"{'#' * level} {title}", ""]
    if parser.description:
        lines += ["```text", parser.description.strip("\n"), "```", ""]
    lines += ["```text", parser.format_usage().strip(), "```", ""]
    actions = [action for action in parser._actions
               if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
               and action.help != argparse.SUPPRESS]
    if actions:
        lines += ["| argument | meaning |", "| --- | --- |"]
        lines += [f"| {_flags(action)} | {_help(parser, action)} |" for action in actions]
        lines.append("")
    if parser.epilog:
        lines += ["```text", parser.epilog.strip("\n"), "```", ""]
    return "\n".join(lines)


def cli_reference() -> str:
    parser = edgetrain_parser()
    parts = [render_parser("edgetrain", parser)]
    for name, subparser in _subcommands(parser):
        parts.append(render_parser(f"edgetrain {name}", subparser))
        for action, nested in _subcommands(subparser):  # e.g. `edgetrain personalise add`
            parts.append(render_parser(f"edgetrain {name} {action}", nested, level=3))
    parts.append("## Server-side programs (torchrun)\n\nStarted as `torchrun [torchrun options] -m MODULE "
                 "ARGS`; gloo on CPU, nccl on CUDA.\n")
    for module_name in TORCHRUN_ENTRY_POINTS:
        module = importlib.import_module(module_name)
        parts.append(render_parser(f"`{module_name}`", module.build_parser(), level=3))
    return "\n".join(parts)


def targets_table() -> str:
    from edgetrain.targets import available_targets, load_target

    lines = ["| target | backend | probe | dtype | memory budget | default methods | description |",
             "| --- | --- | --- | --- | ---: | --- | --- |"]
    for name in available_targets():
        target = load_target(name)
        lines.append(f"| `{name}` | `{target.backend}` | `{target.probe}` | {target.dtype} | "
                     f"{target.memory_budget_mib:,} MiB | {', '.join(target.default_methods)} | "
                     f"{_cell(target.description)} |")
    return "\n".join(lines)


@contextlib.contextmanager
def _fixed_width(columns: int = 100):
    """argparse wraps usage lines to $COLUMNS; pin it so the page does not depend on the terminal."""
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(columns)
    try:
        yield
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


def on_page_markdown(markdown: str, page, config, files) -> str:
    if CLI_MARKER in markdown:
        with _fixed_width():
            markdown = markdown.replace(CLI_MARKER, cli_reference())
    if TARGETS_MARKER in markdown:
        markdown = markdown.replace(TARGETS_MARKER, targets_table())
    return markdown
