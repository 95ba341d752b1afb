"""What reaches the user's terminal, and where everything else goes.

The console shows the progress bar, rlsys's own lines and errors. Libraries'
logs and warnings, Ray's and vLLM's included, go to files under
`output_dir/logs/`: `driver.log` for the driver process and one file per
actor (`train-0.log`, `rollout-0.log`, `reward-1.log` ...), which each actor
writes by redirecting its stdout and stderr at start-up. `--verbose` (or
RLSYS_VERBOSE=1) shows all of it on the console instead, as before.
"""

from __future__ import annotations

import logging
import os
import sys

VERBOSE_ENV = "RLSYS_VERBOSE"
LOG_FILE_ENV = "RLSYS_LOG_FILE"
LOGS_DIR = "logs"

log = logging.getLogger("rlsys")


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


def setup_console(show_everything: bool) -> None:
    """The driver's logging: rlsys's lines on stderr, other libraries' only when verbose
    (until `attach_run_log` gives them a file)."""
    if show_everything:
        os.environ[VERBOSE_ENV] = "1"
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "rlsys_console", False)]:
        root.removeHandler(handler)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("[rlsys] %(message)s"))
    console.rlsys_console = True
    root.addHandler(console)
    log.setLevel(logging.INFO)
    if verbose():
        root.setLevel(logging.INFO)
        return
    console.addFilter(lambda record: record.name.startswith("rlsys"))
    root.setLevel(logging.WARNING)
    logging.captureWarnings(True)
    _quiet_libraries()
    for name in ("datasets", "transformers"):  # their records go to the root logger, hence driver.log
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True


def attach_run_log(output_dir: str) -> str:
    """Send the driver's library logs (and rlsys's lines, too) to output_dir/logs/driver.log;
    returns the logs directory, where the run's actors write their own files."""
    logs = os.path.join(output_dir, LOGS_DIR)
    os.makedirs(logs, exist_ok=True)
    path = os.path.join(logs, "driver.log")
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "rlsys_run_log", False)]:
        root.removeHandler(handler)
        handler.close()
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.rlsys_run_log = True
    root.addHandler(handler)
    return logs


def redirect_actor_output() -> None:
    """In an actor: send its stdout/stderr (Python's and C++'s alike) to the log file the
    driver chose for it, unless the run is verbose."""
    path = os.environ.get(LOG_FILE_ENV)
    if not path:
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(target, 1)
    os.dup2(target, 2)
    os.close(target)
    _quiet_libraries()


def _quiet_libraries() -> None:
    """No progress bars or info chatter from the data and model libraries."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_warning()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_warning()
