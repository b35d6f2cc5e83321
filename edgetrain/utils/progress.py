"""Progress bars for long loops (fit, the CLI's train and profile, the benchmarks): tqdm on an interactive
terminal, nothing otherwise. Step lines still go to the "edgetrain" logger, printed above the bar."""
from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from edgetrain.utils.logs import ROOT_LOGGER


class NoBar:
    """What a disabled bar is: every call does nothing."""

    def update(self, count: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        pass


@contextmanager
def progress_bar(total: int, *, description: str, enabled: bool = True, initial: int = 0,
                 unit: str = "step") -> Iterator[Any]:
    """A tqdm bar of `total` units when `enabled` and stderr is a terminal (tqdm's disable=None), else a
    NoBar. While it is open, records of the edgetrain loggers are written above it instead of through it."""
    if not enabled:
        yield NoBar()
        return
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    with ExitStack() as stack:
        bar = stack.enter_context(tqdm(total=total, initial=initial, desc=description, unit=unit, disable=None,
                                       file=sys.stderr, dynamic_ncols=True, leave=True))
        if not bar.disable:
            # Only loggers that already print to the console: redirecting one without a handler would give it
            # one, and a record would then print twice (there and through the root logger's handler).
            printing = [logger for logger in (logging.getLogger(ROOT_LOGGER), logging.getLogger())
                        if any(_prints_to_console(handler) for handler in logger.handlers)]
            if printing:
                stack.enter_context(logging_redirect_tqdm(loggers=printing))
        yield bar


def _prints_to_console(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) in (sys.stdout, sys.stderr)
