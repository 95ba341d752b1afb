"""The driver's current phase, made visible in the Ray dashboard.

Every remote call the driver makes is named after the phase it serves (for
example `rlvr step 12: generate`), so the dashboard's job view (its task table)
and actor views show what the run is doing and which step it is on.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

_label = "setup"


def set_phase(label: str) -> None:
    global _label
    _label = label


def current_phase() -> str:
    return _label


def call(method, *args, **kwargs):
    """`actor.method.remote(*args, **kwargs)`, named `<current phase>: <method>` in Ray."""
    return method.options(name=f"{_label}: {method._method_name}").remote(*args, **kwargs)


class PhaseTimer:
    """Times one step's phases (as `time/<phase>_s`) and publishes each as the current phase."""

    def __init__(self, stage: str, step: int):
        self.prefix = f"{stage} step {step}"
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        set_phase(f"{self.prefix}: {phase}")
        started = time.perf_counter()
        yield
        key = f"time/{phase}_s"  # a phase run several times in a step adds up
        self.times[key] = self.times.get(key, 0.0) + time.perf_counter() - started
