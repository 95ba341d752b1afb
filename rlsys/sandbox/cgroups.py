"""The run's cgroups: a process budget (pids) and a memory budget (memory) of its own, all its
processes together, on the machine's cgroup version (v1: a hierarchy per controller; v2:
one directory holding both). Through them every process of the run is found and killed at
its end, and a kill by the memory budget is told apart from the program's own signal.

Creating them needs root; without it each is missing, with why (`rlsys.sandbox.local.layers`).
"""

from __future__ import annotations

import itertools
import os
import signal
import time

_ROOT = "/sys/fs/cgroup"
_LIMIT_FILES = {"pids": "pids.max", "memory": "memory.max"}
_V1_LIMIT_FILES = {"pids": "pids.max", "memory": "memory.limit_in_bytes"}
_runs = itertools.count()


class RunCgroups:
    """The run's cgroups by controller (`paths`), and why any is missing (`missing`)."""

    def __init__(self, processes: int, memory_bytes: int):
        self.paths: dict[str, str] = {}
        self.missing: dict[str, str] = {}
        name = f"rlsys-sandbox-{os.getpid()}-{next(_runs)}"
        limits = {"pids": str(processes), "memory": str(memory_bytes)}
        for controller, limit in limits.items():
            if os.geteuid() != 0:
                self.missing[controller] = "not root: no cgroup of the run's own"
                continue
            path = _create(controller, name, limit)
            if path:
                self.paths[controller] = path
            else:
                self.missing[controller] = f"no {controller} controller in {_ROOT} (v1 or v2) to create a cgroup in"

    def processes(self) -> list[int]:
        found: set[int] = set()
        for path in set(self.paths.values()):
            try:
                with open(os.path.join(path, "cgroup.procs")) as f:
                    found.update(int(line) for line in f if line.strip())
            except OSError:
                continue
        return sorted(found)

    def out_of_memory(self) -> bool:
        """Whether the kernel killed a process of the run for the memory budget."""
        path = self.paths.get("memory")
        if path is None:
            return False
        for events in ("memory.events", "memory.oom_control"):  # v2, v1
            try:
                with open(os.path.join(path, events)) as f:
                    counts = dict(line.split() for line in f if len(line.split()) == 2)
                return int(counts.get("oom_kill", 0)) > 0
            except OSError:
                continue
        return False

    def kill_all(self) -> None:
        """SIGKILL every process left in the run's cgroups, until none is."""
        for _ in range(100):
            left = self.processes()
            if not left:
                return
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)

    def remove(self) -> None:
        for path in set(self.paths.values()):
            for _ in range(100):
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:  # busy until its last process is reaped
                    self.kill_all()
                    time.sleep(0.01)


def _create(controller: str, name: str, limit: str) -> str | None:
    """A cgroup `name` with `limit` on `controller`: in its v1 hierarchy, or else in the v2 one
    (the same directory for both controllers)."""
    for base, limit_file in ((os.path.join(_ROOT, controller), _V1_LIMIT_FILES[controller]),
                             (_ROOT, _LIMIT_FILES[controller])):
        if not os.path.exists(os.path.join(base, "cgroup.procs")):  # not a cgroup file system
            continue
        path = os.path.join(base, name)
        try:
            os.makedirs(path, exist_ok=True)
        except OSError:
            continue
        try:
            _write(path, limit_file, limit)
            _no_swap(path, controller, limit)
            return path
        except OSError:
            _remove_if_empty(path)
    return None


def _write(path: str, name: str, value: str) -> None:
    with open(os.path.join(path, name), "w") as f:
        f.write(value)


def _no_swap(path: str, controller: str, limit: str) -> None:
    """The memory budget holds swap too (memory+swap in v1, no swap in v2), where the files exist."""
    if controller != "memory":
        return
    for name, value in (("memory.memsw.limit_in_bytes", limit), ("memory.swap.max", "0")):
        if os.path.exists(os.path.join(path, name)):
            _write(path, name, value)


def _remove_if_empty(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass
