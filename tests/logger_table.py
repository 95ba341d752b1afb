"""logging's table of loggers, walked over a copy in the test processes.

pytest's log capture walks `logging.Logger.manager.loggerDict` without logging's lock as each test's
setup, call and teardown begin (`_pytest.logging.catching_logs.__enter__`), while a thread of the test
process (an in-process vLLM engine's, a tool pool's, Ray's driver threads) may be creating a logger. The
walk then fails with "dictionary changed size during iteration", and pytest, its setup state broken,
errors the next test too. Copying a dict's values is one C call, which no other thread interrupts.
"""

from __future__ import annotations

import logging


class LoggerTable(dict):
    """A dict whose values are a list taken at once, not a live view."""

    def values(self):
        return list(super().values())


def install_logger_table() -> None:
    with logging._lock:  # the lock `logging.getLogger` takes to add a logger
        manager = logging.Logger.manager
        if not isinstance(manager.loggerDict, LoggerTable):
            manager.loggerDict = LoggerTable(manager.loggerDict)
