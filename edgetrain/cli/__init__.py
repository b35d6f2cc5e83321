"""`edgetrain` command line: each subcommand module owns build_parser() and main(args)."""
from __future__ import annotations

import importlib
import sys

from edgetrain.cli.help_format import CliParser

# subcommand -> module under edgetrain.cli (imported only when used: keeps --help fast)
EXIT_CODES = """exit codes:
  0    done
  2    refused: a bad argument, config, file or value (one line on stderr says what and where)
  130  interrupted (Ctrl-C); a run with --checkpoint-dir resumes where it was
  1    a bug in edgetrain: anything else (a traceback); please report it"""

SUBCOMMANDS = {"profile": "profile", "train": "train", "generate": "generate", "eval": "evaluate",
               "export": "export", "export-adapter": "export_adapter", "list": "list",
               "personalise": "personalise"}


def build_parser() -> CliParser:
    """The `edgetrain` parser, every subcommand under it (docs/hooks/cli_reference.py renders it)."""
    return _parser_and_commands()[0]


def _parser_and_commands() -> tuple[CliParser, dict[str, CliParser]]:
    """The `edgetrain` parser and each subcommand's, by name (every subcommand module is imported: not torch)."""
    from edgetrain import __version__

    # Every command's and sub-command's parser is a CliParser (subparsers take their parent's class): help keeps the
    # docstrings' example lines as written.
    parser = CliParser(prog="edgetrain", description="On-device training and profiling.", epilog=EXIT_CODES)
    parser.add_argument("--version", action="version", version=f"edgetrain {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers = {}
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(f"edgetrain.cli.{module_name}")
        subparsers[name] = commands.add_parser(name, help=module.__doc__.splitlines()[0], description=module.__doc__)
        module.build_parser(subparsers[name])
        subparsers[name].add_argument("--config", default=None, metavar="RUN.toml",
                                      help="this command's flags as a TOML table (flags given here win)")
        subparsers[name].add_argument("-q", "--quiet", action="store_true",
                                      help="no progress bar or progress lines; warnings and errors only")
    return parser, subparsers


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, subparsers = _parser_and_commands()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    from edgetrain.registry import EdgetrainError

    try:
        if args.config is not None:
            from edgetrain.cli.config_file import apply_config, read_config

            args = apply_config(parser, subparsers[args.command], argv,
                                read_config(args.config, subparsers[args.command]))
        from edgetrain.cli.root_logging import keep_other_loggers_to_warnings
        from edgetrain.utils.logs import configure_cli_logging
        from edgetrain.utils.progress import stage_progress

        configure_cli_logging(quiet=args.quiet)
        keep_other_loggers_to_warnings()
        command = importlib.import_module(f"edgetrain.cli.{SUBCOMMANDS[args.command]}")
        # Never ten seconds without a line (unless --quiet): a heartbeat line whenever the command has said nothing
        # for a while; the command names its stages (begin_stage) for those lines to say what it is doing.
        with stage_progress(" ".join(filter(None, (args.command, getattr(args, "action", None)))), say_done=False):
            return command.main(args)
    except EdgetrainError as exc:
        print(f"edgetrain {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        from edgetrain.files.space import disk_full_error, is_disk_full

        if not is_disk_full(exc):
            raise
        # Every writer of edgetrain names a full disk itself; a library's own write (or one missed) still ends
        # in the sentence, not a traceback.
        where = exc.filename or "its output"
        print(f"edgetrain {args.command}: error: {disk_full_error(where, part_way=True)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"edgetrain {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
