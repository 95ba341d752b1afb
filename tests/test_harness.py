"""The suite's own machinery, where a fault of it would fail tests at random."""

from __future__ import annotations

import logging
import threading

import pytest
from _pytest.logging import LogCaptureHandler, catching_logs


@pytest.mark.quick
def test_log_capture_survives_a_thread_creating_loggers():
    """pytest's log capture starts (as each test phase does) while another thread adds loggers: with
    logging's own table, about one start in twenty failed ("dictionary changed size during iteration")."""
    assert type(logging.Logger.manager.loggerDict).__name__ == "LoggerTable"
    created = threading.Event()

    def create_loggers():
        for index in range(5_000):
            logging.getLogger(f"test_harness.thread.{index}")
            if index % 10 == 0:
                created.wait(0.0001)

    thread = threading.Thread(target=create_loggers)
    thread.start()
    starts = 0
    try:
        while thread.is_alive():
            with catching_logs(LogCaptureHandler(), level=logging.DEBUG):
                starts += 1
    finally:
        thread.join()
    assert starts > 100, starts
