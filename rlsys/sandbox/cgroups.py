"""The run's cgroups: a memory, a process and a CPU budget of its own, for all its processes
together, on the machine's cgroup version (v1: a hierarchy per controller; v2: one directory
holding all three). Each is made beneath the caller's own cgroup, so a caller confined by
its cgroup stays confined with its runs. Through them every process of the run is found and
killed at its end, and a kill by the memory budget is told apart from the program's own
signal.

Creating them needs root; without it each is missing, with why (`rlsys.sandbox.local.layers`).
"""

from __future__ import annotations

import itertools
import os
import signal
import time

_ROOT = "/sys/fs/cgroup"
_CPU_PERIOD_US = 100_000
_runs = itertools.count()


class RunCgroups:
    """The run's cgroups by controller (`paths`), and why any is missing (`missing`)."""

    def __init__(self, memory_bytes: int, processes: int, cpus: float):
        self.paths: dict[str, str] = {}
        self.missing: dict[str, str] = {}
        name = f"rlsys-sandbox-{os.getpid()}-{next(_runs)}"
        quota = max(1000, int(cpus * _CPU_PERIOD_US))
        limits = {"memory": {"v1": [("memory.limit_in_bytes", str(memory_bytes)),
                                    ("memory.memsw.limit_in_bytes", str(memory_bytes))],  # swap too, where counted
                             "v2": [("memory.max", str(memory_bytes)), ("memory.swap.max", "0")]},
                  "pids": {"v1": [("pids.max", str(processes))], "v2": [("pids.max", str(processes))]},
                  "cpu": {"v1": [("cpu.cfs_period_us", str(_CPU_PERIOD_US)), ("cpu.cfs_quota_us", str(quota))],
                          "v2": [("cpu.max", f"{quota} {_CPU_PERIOD_US}")]}}
        for controller, files in limits.items():
            if os.geteuid() != 0:
                self.missing[controller] = "not root: no cgroup of the run's own"
                continue
            path = _create(controller, name, files)
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


def _create(controller: str, name: str, files: dict[str, list[tuple[str, str]]]) -> str | None:
    """A cgroup `name` with its limits on `controller`: in the controller's v1 hierarchy, else in
    the v2 one (one directory for every controller); beneath the caller's cgroup where the
    kernel allows, else at the top."""
    for version, hierarchy in (("v1", os.path.join(_ROOT, controller)), ("v2", _ROOT)):
        if not os.path.exists(os.path.join(hierarchy, "cgroup.procs")):  # not a cgroup file system
            continue
        for parent in (hierarchy + _own_cgroup(controller if version == "v1" else ""), hierarchy):
            path = os.path.join(parent, name)
            try:
                os.makedirs(path, exist_ok=True)
                for file, value in files[version]:
                    if file == files[version][0][0] or os.path.exists(os.path.join(path, file)):
                        with open(os.path.join(path, file), "w") as f:
                            f.write(value)
                return path
            except OSError:
                _remove_if_empty(path)
    return None


def _own_cgroup(controller: str) -> str:
    """This process's cgroup path in `controller`'s v1 hierarchy, or in the v2 one ("")."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controller in controllers.split(",") if controller else not controllers:
                return path.rstrip("/")
    return ""


def _remove_if_empty(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass
