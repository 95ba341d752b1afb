"""What reaches the user's terminal, and where everything else goes.

The console shows the progress bar, rlsys's own lines and errors. Libraries'
logs and warnings, Ray's and vLLM's included, go to files under
`output_dir/logs/`: `driver.log` for the driver process and one file per
actor (`train-0.log`, `rollout-0.log`, `reward-1.log` ...), which each actor
writes by redirecting its stdout and stderr at start-up. `--verbose` (or
RLSYS_VERBOSE=1) shows all of it on the console instead, as before.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import psutil

VERBOSE_ENV = "RLSYS_VERBOSE"
LOG_FILE_ENV = "RLSYS_LOG_FILE"
STARTUP_LOG_ENV = "RLSYS_STARTUP_LOG"
"""A file that every actor (and the driver's Ray start) appends a line to when it is ready:
what its start-up cost (`record_startup`)."""
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
    console = _ConsoleHandler(sys.stderr)
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


class _ConsoleHandler(logging.StreamHandler):
    """Lines above the progress bar, which tqdm then draws again below them."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


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


def redirect_actor_output(path: str | None = None) -> None:
    """In an actor: send its stdout/stderr (Python's and C++'s alike) to the log file the
    driver chose for it (`path`, else the one its environment names), unless the run is verbose.
    An actor taken into another run's group (`TrainWorker.reuse`) is given its new file."""
    path = path or os.environ.get(LOG_FILE_ENV)
    if not path:
        return
    os.environ[LOG_FILE_ENV] = path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(target, 1)
    os.dup2(target, 2)
    os.close(target)
    os.environ.update(QUIET_LIBRARIES_ENV)  # for the libraries this actor imports from now on
    _quiet_libraries(imported_only=True)


QUIET_LIBRARIES_ENV = {"TRANSFORMERS_VERBOSITY": "warning", "DATASETS_VERBOSITY": "warning",
                       "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
"""What `_quiet_libraries` sets, as the environment variables the libraries read when imported: an
actor that never imports them (a reward worker) does not pay seconds of imports to quiet them."""


class StartupClock:
    """Started where an actor's (or a component's) start-up begins; `record_startup` reads it."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()


def record_startup(kind: str, clock: StartupClock, reused: bool = False) -> dict[str, float]:
    """What the start-up of `kind` (train, rollout, reward, tool, a served model's engine, the Ray
    cluster) cost: the wall and CPU seconds since `clock`, and for an actor's own process the CPU it
    has used since it began, its imports included (`reused`: the process served an earlier group,
    so only the seconds since `clock` are this start's). With RLSYS_STARTUP_LOG set, it is also
    appended there as a JSON line (the test suite counts start-ups per test this way)."""
    record = {"kind": kind, "pid": os.getpid(), "time": time.time(), "reused": reused,
              "init_s": round(time.perf_counter() - clock.wall, 3),
              "init_cpu_s": round(time.process_time() - clock.cpu, 3),
              "process_cpu_s": round(time.process_time(), 3),
              "process_s": round(time.time() - psutil.Process().create_time(), 3)}
    path = os.environ.get(STARTUP_LOG_ENV)
    if path:
        with open(path, "a") as f:  # one short write: lines from concurrent processes stay whole
            f.write(json.dumps(record) + "\n")
    return record


def _quiet_libraries(imported_only: bool = False) -> None:
    """No progress bars or info chatter from the data and model libraries (`imported_only`: from
    those this process has imported already)."""
    if not imported_only or "datasets" in sys.modules:
        import datasets

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_warning()
    if not imported_only or "transformers" in sys.modules:
        import transformers

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_warning()
