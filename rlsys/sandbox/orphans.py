"""Finding a run's processes without cgroups: this process becomes a child subreaper, so a
process that leaves the run's session is reparented here, found as an orphan in the run's
environment, killed and reaped. Only needed where a run has neither cgroups nor a PID
namespace (without root and without user namespaces, with `allow_weaker`)."""

from __future__ import annotations

import ctypes
import os
import signal
import tempfile

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    return ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def kill_orphans(run_pid: int) -> None:
    for _ in range(50):
        left = _orphans(run_pid)
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


def _orphans(run_pid: int) -> list[int]:
    """This process's children other than the run's own process (reparented here as a subreaper)."""
    me, children = os.getpid(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and int(pid) != run_pid and fields[0] != "Z":
            children.append(int(pid))
    return [pid for pid in children if _is_sandboxed(pid)]


def _is_sandboxed(pid: int) -> bool:
    """Whether a process runs in a sandbox's environment (its TMPDIR is a run's directory)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return b"TMPDIR=" + tempfile.gettempdir().encode() + b"/rlsys-sandbox-" in f.read()
    except OSError:
        return False
