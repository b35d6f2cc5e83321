"""How edgetrain speaks: through `logging`, under the "edgetrain" logger, never print().

The library only creates loggers. Warnings (a probe that does not work here, a budget fallback, a damaged
checkpoint skipped on resume) reach stderr through logging's last-resort handler when the application has
not configured logging; progress (step lines, stage summaries) is INFO, silent unless asked for. The CLI
asks: `configure_cli_logging` shows INFO and up, or only warnings with --quiet.
"""
from __future__ import annotations

import logging
import sys

ROOT_LOGGER = "edgetrain"
_CLI_HANDLER_NAME = "edgetrain-cli"


def get_logger(module_name: str) -> logging.Logger:
    """The logger for a module of edgetrain (pass __name__); everything lands under "edgetrain"."""
    if module_name != ROOT_LOGGER and not module_name.startswith(ROOT_LOGGER + "."):
        module_name = f"{ROOT_LOGGER}.{module_name}"
    return logging.getLogger(module_name)


class CurrentStderrHandler(logging.StreamHandler):
    """Writes each record to whatever sys.stderr is when the record is made (a test's capture, a redirected
    stream), not to the stderr of the moment the handler was created."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure_cli_logging(quiet: bool = False) -> logging.Handler:
    """Send edgetrain's records to stderr as `edgetrain: message`: INFO and up, or WARNING and up when quiet.
    Calling it again replaces the level of the handler it made, never adds a second one."""
    logger = logging.getLogger(ROOT_LOGGER)
    handler = next((h for h in logger.handlers if h.get_name() == _CLI_HANDLER_NAME), None)
    if handler is None:
        handler = CurrentStderrHandler()
        handler.set_name(_CLI_HANDLER_NAME)
        handler.setFormatter(logging.Formatter("edgetrain: %(message)s"))
        logger.addHandler(handler)
    level = logging.WARNING if quiet else logging.INFO
    handler.setLevel(level)
    logger.setLevel(level)
    return handler
