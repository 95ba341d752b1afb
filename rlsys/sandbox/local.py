"""Run untrusted Python in a subprocess confined on this machine.

Each run gets an empty working directory of its own, a scrubbed environment, limits on
wall time, CPU time, memory, processes, file size and open files, no network, read access
to the system's and Python's directories only, and no write access outside its directory
(`rlsys.sandbox.launch` applies them). At the end, however it ended, every process the run
started is killed: through its pids cgroup (as root), or by its session and as orphans of
this process (it is made a child subreaper).

What holds depends on the machine (`guarantees()` says): Landlock needs Linux 5.13 (TCP
rules 6.7, signal scoping 6.12); a network namespace needs root or unprivileged user
namespaces; a pids cgroup of its own needs root and a pids controller. Without one the
process limit counts all of this user's processes (the run's budget on top of what the
user runs), and a process that leaves the run's session is found as an orphan.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from rlsys.sandbox.launch import landlock_abi

_LAUNCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch.py")
_OUTPUT_LIMIT = 1 << 16
"""Bytes of stdout and stderr kept (each); the file-size limit bounds what a run writes."""
_PR_SET_CHILD_SUBREAPER = 36
_runs = itertools.count()


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    """Wall-clock time; past it every process of the run is killed."""
    cpu_s: int = 10
    """CPU seconds of each process (SIGXCPU, then SIGKILL)."""
    memory_mb: int = 1024
    """Address space of each process: a larger allocation fails (MemoryError in Python)."""
    processes: int = 32
    """Processes and threads the run may have at once."""
    file_mb: int = 16
    """Largest file the run may write (its stdout and stderr included)."""
    open_files: int = 64


@dataclass(frozen=True)
class SandboxResult:
    status: str
    """"ok" (exit code 0), "error" (another exit code), "timeout" (wall or CPU time), or "killed"
    (a signal: the file-size limit, or the program's own)."""
    exit_code: int | None
    stdout: str
    stderr: str
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def run_python(code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` as a Python program reading `stdin`, confined as the module says."""
    workdir = tempfile.mkdtemp(prefix="rlsys-sandbox-")
    outputs = tempfile.mkdtemp(prefix="rlsys-sandbox-out-")
    cgroup = _new_cgroup(limits.processes) if os.geteuid() == 0 else None
    if cgroup is None:
        _become_subreaper()
    try:
        with open(os.path.join(workdir, "main.py"), "w") as f:
            f.write(code)
        return _run(workdir, outputs, stdin, limits, cgroup)
    finally:
        if cgroup is not None:
            _remove_cgroup(cgroup)
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(outputs, ignore_errors=True)


def guarantees() -> dict[str, bool]:
    """What the sandbox enforces on this machine."""
    abi, root = landlock_abi(), os.geteuid() == 0
    cgroup = _new_cgroup(1) if root else None
    if cgroup is not None:
        _remove_cgroup(cgroup)
    return {"reads and writes confined (Landlock)": abi >= 1,
            "no network": root or abi >= 4,
            "a process budget of its own, every process killed through it (pids cgroup)": cgroup is not None,
            "no signals to processes outside": abi >= 6}


def _run(workdir: str, outputs: str, stdin: str, limits: SandboxLimits, cgroup: str | None) -> SandboxResult:
    settings = {"cpu_s": limits.cpu_s, "memory_bytes": limits.memory_mb << 20, "file_bytes": limits.file_mb << 20,
                "open_files": limits.open_files, "processes": limits.processes, "workdir": workdir,
                "cgroup": cgroup, "readable": _readable()}
    command = [sys.executable, "-I", "-S", _LAUNCH, json.dumps(settings), "--", sys.executable, "-I", "-B", "main.py"]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
           "PYTHONHASHSEED": "0"}
    stdout_path, stderr_path = os.path.join(outputs, "stdout"), os.path.join(outputs, "stderr")
    started = time.monotonic()
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        process = subprocess.Popen(command, cwd=workdir, env=env, stdin=subprocess.PIPE, stdout=out, stderr=err,
                                   start_new_session=True)
        timed_out = False
        try:
            process.communicate(stdin.encode(), timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_everything(process.pid, cgroup)
            process.wait()
    elapsed = time.monotonic() - started
    code = process.returncode
    status = _status(code, timed_out)
    return SandboxResult(status, code if code >= 0 else None, _read(stdout_path), _read(stderr_path), elapsed)


def _status(code: int, timed_out: bool) -> str:
    if timed_out or code == -signal.SIGXCPU:
        return "timeout"
    if code < 0:
        return "killed"
    return "ok" if code == 0 else "error"


def _kill_everything(pid: int, cgroup: str | None) -> None:
    """Kill the run's session, then whatever escaped it: every process left in its cgroup, or
    every orphan of this process (a child subreaper)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for _ in range(50):
        left = _cgroup_processes(cgroup) if cgroup is not None else _orphans(pid)
        if not left:
            return
        for process in left:
            _kill(process, reap=cgroup is None)
        time.sleep(0.01)


def _readable() -> list[str]:
    """What a run may read: the system's directories and this Python's (its install, the venv)."""
    system = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc", "/dev", "/proc"]
    python = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    return system + sorted(python)


def _new_cgroup(processes: int) -> str | None:
    """A pids cgroup of its own (v1 or v2) with `processes` at most, or None where there is none."""
    name = f"rlsys-sandbox-{os.getpid()}-{next(_runs)}"
    for base in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup"):
        path = os.path.join(base, name)
        try:
            os.mkdir(path)
        except OSError:
            continue
        try:
            with open(os.path.join(path, "pids.max"), "w") as f:
                f.write(str(processes))
            return path
        except OSError:
            os.rmdir(path)
    return None


def _cgroup_processes(cgroup: str) -> list[int]:
    try:
        with open(os.path.join(cgroup, "cgroup.procs")) as f:
            return [int(line) for line in f if line.strip()]
    except OSError:
        return []


def _remove_cgroup(cgroup: str) -> None:
    for _ in range(100):
        try:
            os.rmdir(cgroup)
            return
        except FileNotFoundError:
            return
        except OSError:  # busy until its last process is reaped
            for process in _cgroup_processes(cgroup):
                _kill(process)
            time.sleep(0.01)


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


def _kill(pid: int, reap: bool = False) -> None:
    """SIGKILL `pid`; `reap` it too when it is an orphan of this process (not the run's own
    process, whose status `Popen.wait` collects)."""
    try:
        os.kill(pid, signal.SIGKILL)
        if reap:
            os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _become_subreaper() -> None:
    ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _read(path: str) -> str:
    with open(path, "rb") as f:
        data = f.read(_OUTPUT_LIMIT + 1)
    text = data[:_OUTPUT_LIMIT].decode(errors="replace")
    return text + "\n...(output truncated)" if len(data) > _OUTPUT_LIMIT else text
