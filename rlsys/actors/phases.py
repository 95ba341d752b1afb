"""The driver's current phase, made visible in the Ray dashboard and on the console.

Every remote call the driver makes is named after the phase it serves (for
example `rlvr step 12: generate`), so the dashboard's job view (its task table)
and actor views show what the run is doing and which step it is on; while one
phase lasts longer than `HEARTBEAT_S`, the console says so (`Heartbeat`).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager

from rlsys.tracking.trace import span

log = logging.getLogger(__name__)

HEARTBEAT_S = 30.0
"""How long a phase may run before the console hears from it, and then how often."""

_label = "setup"
_since = time.monotonic()


def set_phase(label: str) -> None:
    global _label, _since
    if label != _label:
        _since = time.monotonic()
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
        with span(phase):
            yield
        key = f"time/{phase}_s"  # a phase run several times in a step adds up
        self.times[key] = self.times.get(key, 0.0) + time.perf_counter() - started


class Heartbeat:
    """While it is on (a `with` block around a run), a console line every `every_s` seconds that one phase
    goes on: `rlvr step 3: generate: still running after 60 s`. No minute passes in silence, however long
    a model takes to load or an engine to start."""

    def __init__(self, every_s: float = HEARTBEAT_S):
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="rlsys-heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        beats = 0
        phase = None
        while not self._stop.wait(min(self.every_s, 5.0) / 5):
            label, lasted = _label, time.monotonic() - _since
            if (label, _since) != phase:
                phase, beats = (label, _since), 0
            if lasted >= (beats + 1) * self.every_s:
                beats = int(lasted // self.every_s)
                log.info("%s: still running after %.0f s", label, lasted)
