"""The root logger of an `edgetrain` process: other libraries' warnings, and never a second copy of edgetrain's lines.

ExecuTorch logs through logging.debug(), whose first call gives a root logger without handlers a handler of
everything (logging.basicConfig). From then on each progress line of edgetrain's printed twice: once by the CLI's
handler (edgetrain.utils.logs.configure_cli_logging), once by that one. The CLI gives the root logger, first, the
handler Python's last resort would have been: warnings and up of every logger but edgetrain's, to stderr.
"""
from __future__ import annotations

import logging
import sys

from edgetrain.utils.logs import ROOT_LOGGER


class OtherWarningsHandler(logging.Handler):
    """Warnings and up of loggers outside "edgetrain", to the stderr of the moment. Not a StreamHandler: a progress
    bar (edgetrain.utils.progress) reroutes those, and would lose this one's filter with it."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def filter(self, record: logging.LogRecord) -> bool:
        ours = record.name == ROOT_LOGGER or record.name.startswith(ROOT_LOGGER + ".")
        return not ours and super().filter(record)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:  # logging's rule: a handler that fails reports it and lets the program go on
            self.handleError(record)


def keep_other_loggers_to_warnings() -> None:
    """Give the root logger an OtherWarningsHandler when it has no handler; one that has handlers (the
    application's, a test runner's) is left as it is."""
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(OtherWarningsHandler())
