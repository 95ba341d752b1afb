"""Run untrusted Python on this machine, confined: the code a model writes is hostile.

Each run is a process tree of its own (`rlsys.sandbox.launch` builds it) with, in layers:
- `memory`, `pids`, `cpu`: cgroups of its own beneath the caller's, a memory, a process and
  a CPU budget for all its processes together, through which every one of them is also
  killed at the end;
- `mount`: a root file system of its own: an empty tmpfs of `disk_mb` (its home directory,
  /tmp and /dev/shm), the system's and Python's directories read-only, a minimal /etc and
  /dev; no other file, Unix socket or device of the machine is in view;
- `pid`: a PID namespace with its own /proc: only its own processes are in view or in reach;
- `network`, `ipc`: namespaces with no network interface up, no abstract Unix socket, System
  V object or message queue of the machine's;
- `user`: an unprivileged user id of its own that owns nothing on the machine, with no
  capability;
- `landlock`: reads and executes beneath the system's and Python's directories only, writes
  beneath its home, /tmp and /dev/shm only, no TCP, no signal or abstract socket outside;
- `seccomp`: no new namespace, mount, ptrace, bpf, io_uring, key or kernel-module call, no
  socket but IPv4/IPv6 ones (`rlsys.sandbox.syscall_filter`);
and per process: CPU time, address space, file size, open files and stack size limits. At
the end, however it ended, nothing of the run is left: its processes, files, cgroups, and
files it hid in Unix sockets in flight (`_collect_unix_garbage`).

`layers()` says what holds on this machine. A run where one is missing is refused
(`SandboxUnavailable`) unless its limits accept weaker isolation (`allow_weaker`).
"""

from __future__ import annotations

import ast
import functools
import logging
import marshal
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from rlsys.sandbox import syscall_filter
from rlsys.sandbox.cgroups import RunCgroups
from rlsys.sandbox.orphans import become_subreaper, kill_orphans

log = logging.getLogger(__name__)
_LAUNCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch.py")
_OUTPUT_LIMIT = 1 << 16
"""Bytes of stdout and stderr kept (each); the file-size limit bounds what a run writes."""
SANDBOX_UIDS = range(1_500_000_000, 1_500_000_000 + (1 << 24))
"""As root, each run's program is a user (and group) drawn from here: one that owns nothing on the
machine, and rarely the same for two runs at once, so that they share no per-user kernel limit
(inotify instances, file descriptors in flight, pipe buffers)."""
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
"""The program's environment (the launcher adds HOME and TMPDIR): nothing of the caller's."""
LAYERS = ("memory", "pids", "cpu", "mount", "pid", "network", "ipc", "user", "landlock", "seccomp")


class SandboxUnavailable(RuntimeError):
    """A layer of isolation the run requires is missing on this machine."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use. Each budget is per run (all its processes together) or per process."""

    wall_s: float = 10.0
    """Per run: wall-clock time; past it every process of the run is killed."""
    cpu_s: int = 10
    """Per process: CPU seconds (SIGXCPU, then SIGKILL)."""
    memory_mb: int = 1024
    """Per run: memory of all its processes and its files (a memory cgroup; past it the kernel kills
    one). Each process's address space is capped at the same figure, so one allocation past it fails
    with MemoryError."""
    processes: int = 32
    """Per run: processes and threads at once."""
    cpus: float = 1.0
    """Per run: CPUs its processes may keep busy together (a CPU cgroup's quota)."""
    disk_mb: int = 64
    """Per run: the files it writes, in its home, /tmp and /dev/shm together (one tmpfs)."""
    file_mb: int = 16
    """Per process: the largest file it may write (stdout and stderr included); a write past it fails
    (Python: OSError, File too large)."""
    open_files: int = 64
    """Per process: open file descriptors."""
    stack_mb: int = 8
    """Per process: the main thread's stack, so runaway native recursion fails fast."""
    allow_weaker: bool = False
    """Run even where this machine cannot give every layer (`layers()` says which); otherwise such a
    run raises SandboxUnavailable."""


@dataclass(frozen=True)
class SandboxResult:
    status: str
    """"ok" (exit code 0), "error" (another exit code), "timeout" (wall or CPU time), or "killed" (a
    signal: the memory budget, a native stack overflow, or the program's own)."""
    exit_code: int | None
    stdout: str
    stderr: str
    wall_s: float
    layers: dict[str, float] | None = None
    """Seconds the launcher spent on each layer of this run."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def run_python(code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` as a Python program reading `stdin`, confined as the module says."""
    report, result = _launch(code, stdin, limits, probe=False)
    if "refused" in report:
        raise SandboxUnavailable(_refusal(report["refused"]))
    return result


@functools.cache
def layers() -> dict[str, str]:
    """Each layer of isolation: "" where this machine gives it, otherwise why not (measured once per
    process by a probe run that applies every layer and stops before executing anything)."""
    report, _ = _launch("", "", SandboxLimits(), probe=True)
    found = report.get("layers", {})
    return {name: found.get(name, "the probe did not reach it") for name in LAYERS}


def guarantees() -> dict[str, bool]:
    """Whether each layer holds on this machine."""
    return {name: not why for name, why in layers().items()}


def limits_from(settings: dict) -> SandboxLimits:
    """SandboxLimits from a config mapping; an unknown key is a ValueError naming it."""
    unknown = sorted(set(settings) - set(SandboxLimits.__dataclass_fields__))
    if unknown:
        known = ", ".join(SandboxLimits.__dataclass_fields__)
        raise ValueError(f"unknown sandbox setting {unknown[0]!r}; known: {known}")
    return SandboxLimits(**settings)


def require_isolation(limits: SandboxLimits) -> None:
    """Where a stage that runs code is configured, before anything runs: raise SandboxUnavailable
    when a layer is missing and `limits` do not accept weaker isolation; log what holds."""
    missing = {name: why for name, why in layers().items() if why}
    if missing and not limits.allow_weaker:
        raise SandboxUnavailable(f"{_refusal(missing)}; allow_weaker: true (tools.sandbox for the python tool, "
                                 "the term's kwargs for code_exec) runs with what holds")
    _log_layers()


@functools.cache
def _log_layers() -> None:
    missing = {name: why for name, why in layers().items() if why}
    held = [name for name in LAYERS if name not in missing]
    weaker = "; weaker isolation accepted, missing: " + "; ".join(f"{k} ({v})" for k, v in missing.items())
    log.info("code sandbox layers held: %s%s", ", ".join(held), weaker if missing else "")


def _refusal(missing: dict[str, str]) -> str:
    missing = {name: missing[name] for name in sorted(missing, key=LAYERS.index)}
    name, why = next(iter(missing.items()))
    more = f" (and {len(missing) - 1} more layer(s): {', '.join(list(missing)[1:])})" if len(missing) > 1 else ""
    return f"the code sandbox's {name} layer is missing on this machine: {why}{more}"


def _launch(code: str, stdin: str, limits: SandboxLimits, probe: bool) -> tuple[dict, SandboxResult]:
    """The run's directories and cgroups, made before and removed after it, whatever happens."""
    workdir = tempfile.mkdtemp(prefix="rlsys-sandbox-")
    outputs = tempfile.mkdtemp(prefix="rlsys-sandbox-out-")
    cgroups = RunCgroups(limits.memory_mb << 20, limits.processes, limits.cpus)
    try:
        program = os.path.join(workdir, "main.py")
        with open(program, "w") as f:
            f.write(code)
        os.chmod(program, 0o644)
        return _start_and_wait(workdir, outputs, stdin, limits, cgroups, probe)
    finally:
        cgroups.remove()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(outputs, ignore_errors=True)
        _collect_unix_garbage()


def _start_and_wait(workdir: str, outputs: str, stdin: str, limits: SandboxLimits, cgroups: RunCgroups,
                    probe: bool) -> tuple[dict, SandboxResult]:
    """Start the launcher, wait for it within the wall limit, and read its report."""
    report_read, report_write = os.pipe()
    settings = _settings(workdir, limits, cgroups, report_write, probe)
    command = [sys.executable, "-I", "-S", _LAUNCH, marshal.dumps(settings).hex(), "--", sys.executable, "-I", "-B",
               "main.py"]
    paths = {name: os.path.join(outputs, name) for name in ("stdin", "stdout", "stderr")}
    with open(paths["stdin"], "w") as f:
        f.write(stdin)
    subreaper = not cgroups.paths and become_subreaper()
    started = time.monotonic()
    with open(paths["stdin"], "rb") as given, open(paths["stdout"], "wb") as out, open(paths["stderr"], "wb") as err:
        process = subprocess.Popen(command, cwd=workdir, env=_ENV, stdin=given, stdout=out, stderr=err,
                                   start_new_session=True, pass_fds=(report_write,))
        os.close(report_write)
        try:
            timed_out = not _exits_within(process, limits.wall_s)
        finally:
            _kill_everything(process.pid, cgroups, subreaper)
            process.wait()
    elapsed = time.monotonic() - started
    report = _read_report(report_read)
    result = _result(report, timed_out, cgroups, limits, elapsed, _read(paths["stdout"]), _read(paths["stderr"]))
    return report, result


def _exits_within(process: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for the launcher's exit, woken by it through a pidfd (Popen.wait with a timeout polls,
    sleeping up to 50 ms between looks)."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except OSError:  # Linux before 5.3
        try:
            process.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        poller = select.poll()  # not select.select: a caller may hold descriptors numbered past 1023
        poller.register(pidfd, select.POLLIN)
        return bool(poller.poll(timeout_s * 1000))
    finally:
        os.close(pidfd)


def _settings(workdir: str, limits: SandboxLimits, cgroups: RunCgroups, report_fd: int, probe: bool) -> dict:
    bpf, no_filter = syscall_filter.compiled()
    missing = dict(cgroups.missing, **({"seccomp": no_filter} if no_filter else {}))
    return {"cpu_s": limits.cpu_s, "memory_bytes": limits.memory_mb << 20, "file_bytes": limits.file_mb << 20,
            "open_files": limits.open_files, "stack_bytes": limits.stack_mb << 20, "disk_bytes": limits.disk_mb << 20,
            "nproc": 0 if "pids" in cgroups.paths else _user_processes() + limits.processes,
            "cgroups": cgroups.paths, "missing": missing, "workdir": workdir, "readable": _readable(),
            **_user(),
            "seccomp": bpf.hex(), "env": _ENV, "report_fd": report_fd, "require": not limits.allow_weaker,
            "probe": probe}


def _user() -> dict[str, int]:
    """As root, a user of the run's own (its group of the same number); otherwise the caller's."""
    if os.geteuid() != 0:
        return {"uid": os.getuid(), "gid": os.getgid()}
    uid = SANDBOX_UIDS[secrets.randbelow(len(SANDBOX_UIDS))]
    return {"uid": uid, "gid": uid}


def _collect_unix_garbage() -> None:
    """Closing a Unix socket makes the kernel collect unreachable sockets in flight: a program can
    hide files (memfds, its tmpfs) in a cycle of sockets that carry each other, which would
    otherwise outlive the run, its cgroup and its namespaces until any Unix socket closes."""
    ends = socket.socketpair()
    for end in ends:
        end.close()


def _readable() -> list[str]:
    """What a run may read: the system's directories and this Python's (its install, the venv), each
    also by its resolved path: an environment reached through a symbolic link (as conda and shared
    venvs are) is reproduced as the link, which needs what it points to."""
    system = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin"]
    python = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    return system + sorted(python | {os.path.realpath(path) for path in python})


def _user_processes() -> int:
    """Tasks (threads included, as the kernel counts them for RLIMIT_NPROC) of this user: without a
    pids cgroup, the run's budget comes on top of them."""
    count, uid = 0, os.getuid()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                count += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return count


def _kill_everything(pid: int, cgroups: RunCgroups, subreaper: bool) -> None:
    """Kill the launcher's session (its init's death empties the run's PID namespace), then whatever
    is left: every process in the run's cgroups, or every orphan of this process."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if cgroups.paths:
        cgroups.kill_all()
    elif subreaper:
        kill_orphans(pid)


def _read_report(fd: int) -> dict:
    """The launcher's report: each layer's outcome and cost, the program's wait status, a refusal."""
    with os.fdopen(fd, "rb") as f:
        lines = f.read().decode(errors="replace").splitlines()
    report: dict = {"layers": {}, "costs": {}}
    for line in lines:
        record = ast.literal_eval(line)
        if "layer" in record:
            report["layers"][record["layer"]] = record["why"]
            report["costs"][record["layer"]] = record["s"]
        else:
            report.update(record)
    return report


def _result(report: dict, timed_out: bool, cgroups: RunCgroups, limits: SandboxLimits, elapsed: float,
            stdout: str, stderr: str) -> SandboxResult:
    status_word, code = report.get("status"), None
    if "launch_error" in report:
        stderr += f"\n[sandbox: {report['launch_error']}]"
    if timed_out:
        status = "timeout"
    elif status_word is None:  # the run's init did not report: it was killed
        status = "killed"
    elif os.WIFSIGNALED(status_word):
        status = "timeout" if os.WTERMSIG(status_word) == signal.SIGXCPU else "killed"
        if status == "killed" and cgroups.out_of_memory():
            stderr += f"\n[killed: the run's memory budget of {limits.memory_mb} MiB was exceeded]"
    else:
        code = os.WEXITSTATUS(status_word)
        status = "ok" if code == 0 else "error"
    return SandboxResult(status, code, stdout, stderr, elapsed, report["costs"])


def _read(path: str) -> str:
    with open(path, "rb") as f:
        data = f.read(_OUTPUT_LIMIT + 1)
    text = data[:_OUTPUT_LIMIT].decode(errors="replace")
    return text + "\n...(output truncated)" if len(data) > _OUTPUT_LIMIT else text
