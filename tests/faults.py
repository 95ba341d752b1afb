"""Faults injected into a run at a point the test chooses, not at a moment a clock picks: an actor's
process found by its log file, and signals sent to actors right after the driver logs a step (the
run in this process), before the next step starts."""

from __future__ import annotations

import os
import signal
import time

import psutil


def worker_process(log_dir: str, worker: str) -> psutil.Process:
    """The process of an rlsys actor, found by the log file the driver gave it (logs/<worker>.log):
    named in its environment when it started, or open as its output (an actor kept from an earlier
    group, `rlsys.actors.kept_actors`, was given the file later)."""
    wanted = os.path.join(log_dir, f"{worker}.log")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for process in psutil.process_iter():
            try:
                if process.environ().get("RLSYS_LOG_FILE") == wanted or \
                        any(f.path == wanted for f in process.open_files()):
                    return process
            except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
        time.sleep(0.5)
    raise AssertionError(f"no process writes {wanted}")


def signal_after_steps(monkeypatch, output_dir: str, faults: dict[int, list[tuple[str, signal.Signals]]]) -> dict:
    """Once the run writing `output_dir` has logged step k (the first time), send each (worker,
    signal) of `faults[k]`: SIGKILL (waited for until the process is gone) or SIGSTOP. The next step
    then meets the dead or hung worker whatever the machine's speed. Returns the faults still
    pending, so the test can assert they all fired."""
    from rlsys.tracking.tracker import JsonlBackend

    pending = {step: list(signals) for step, signals in faults.items()}
    metrics_file = os.path.join(output_dir, "metrics.jsonl")
    log = JsonlBackend.log

    def log_then_signal(backend: JsonlBackend, step: int, metrics: dict) -> None:
        log(backend, step, metrics)
        if backend._metrics.name != metrics_file:
            return
        for worker, sent in pending.pop(step, []):
            process = worker_process(os.path.join(output_dir, "logs"), worker)
            process.send_signal(sent)
            if sent == signal.SIGKILL:
                process.wait(60)

    monkeypatch.setattr(JsonlBackend, "log", log_then_signal)
    return pending
