"""The launcher's confining steps other than the file system and Landlock: the run's cgroups,
its namespaces, the process's resource limits, its user and capabilities, and the seccomp
filter. Each returns "" when it holds, otherwise why not.

Imported by the launcher as a sibling module (it runs with `-I -S`): standard library only.
"""

from __future__ import annotations

import ctypes
import os
import resource

_CLONE_NEWNS, _CLONE_NEWCGROUP, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_SET_SECCOMP = 1, 4, 24, 22
_PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4
_SECCOMP_MODE_FILTER = 2
_CAPABILITY_VERSION_3 = 0x20080522
_BPF_INSTRUCTION_BYTES = 8

_libc = ctypes.CDLL(None, use_errno=True)


class _SockFilterProgram(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def join_cgroup(path: str) -> str:
    """Move this process (and so all it starts) into one of the run's cgroups."""
    try:
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    except OSError as err:
        return f"joining {path}: {err.strerror}"
    return ""


def unshare_namespaces(root: bool) -> str:
    """New mount, PID (for the children), network, IPC, UTS and cgroup namespaces. Without root
    they come through an unprivileged user namespace, mapping the caller's ids to themselves."""
    flags = _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS | _CLONE_NEWCGROUP
    uid, gid = os.getuid(), os.getgid()
    if _libc.unshare(flags if root else flags | _CLONE_NEWUSER) != 0:
        number = ctypes.get_errno()
        how = "" if root else " (without root they need unprivileged user namespaces)"
        return f"unshare: {os.strerror(number)}{how}"
    if not root:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    return ""


def die_with_parent() -> None:
    """SIGKILL this process when its parent ends, and keep its memory and files out of reach of
    processes of the same user (no ptrace, no /proc/PID/fd)."""
    _libc.prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0)
    _libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


def stdin_in_memory() -> None:
    """The program's standard input as an in-memory file of its own, which it may reopen
    (`/dev/stdin`); Landlock would refuse reopening the caller's file."""
    chunks = []
    while chunk := os.read(0, 1 << 16):
        chunks.append(chunk)
    memory = os.memfd_create("stdin")
    os.write(memory, b"".join(chunks))
    os.lseek(memory, 0, os.SEEK_SET)
    os.dup2(memory, 0)
    os.close(memory)


def limit_resources(settings: dict) -> None:
    """This process's limits, inherited by what it starts (each process has its own)."""
    cpu_s = settings["cpu_s"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))  # SIGXCPU, then SIGKILL
    for kind, value in ((resource.RLIMIT_AS, settings["memory_bytes"]), (resource.RLIMIT_FSIZE, settings["file_bytes"]),
                        (resource.RLIMIT_NOFILE, settings["open_files"]), (resource.RLIMIT_CORE, 0),
                        (resource.RLIMIT_STACK, settings["stack_bytes"])):
        resource.setrlimit(kind, (value, value))
    if settings.get("nproc"):
        resource.setrlimit(resource.RLIMIT_NPROC, (settings["nproc"], settings["nproc"]))


def become_unprivileged(uid: int, gid: int, root: bool) -> str:
    """As root: the user `uid` (owning nothing on the machine) with no supplementary group and no
    capability in any set. Otherwise the caller's user stays, with its namespace's capabilities
    dropped."""
    for capability in range(64):
        _libc.prctl(_PR_CAPBSET_DROP, capability, 0, 0, 0)
    _libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    if root:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    header = (ctypes.c_uint32 * 2)(_CAPABILITY_VERSION_3, 0)
    _libc.capset(header, (ctypes.c_uint32 * 6)())
    _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if not root:
        return "not root: the program runs as the calling user"
    return ""


def install_seccomp(bpf: bytes) -> str:
    """Load a compiled classic-BPF seccomp filter (no_new_privs is already set)."""
    if len(bpf) % _BPF_INSTRUCTION_BYTES:
        return "the seccomp filter is not whole BPF instructions"
    buffer = ctypes.create_string_buffer(bpf, len(bpf))
    program = _SockFilterProgram(len(bpf) // _BPF_INSTRUCTION_BYTES, ctypes.addressof(buffer))
    if _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0) != 0:
        return f"prctl(PR_SET_SECCOMP): {os.strerror(ctypes.get_errno())}"
    return ""
