"""The sandbox's launcher: a fresh, single-threaded Python process that confines itself, then
becomes the program to run (`os.execv`). Run as `python -I -S launch.py SETTINGS_JSON -- ARGV...`.

It imports nothing of rlsys (it runs before any confinement and must start fast), and it
exists as a process of its own because confining happens between fork and exec, which is
unsafe to do in Python from a multi-threaded process (a Ray worker).

In order, each step only where the machine allows it (`rlsys.sandbox.local.guarantees`):
1. resource limits: CPU seconds, address space, file size, open files, no core files;
2. the run's process budget: as root, a pids cgroup of its own (its processes are also
   killed through it); otherwise the user's process limit, set to what the user already
   runs plus the budget;
3. no network: a network namespace of its own (as root; otherwise through an unprivileged
   user namespace where the kernel allows one);
4. as root, every capability dropped (the run keeps user id 0 but none of root's powers);
5. Landlock (Linux 5.13+): reading and executing only beneath the directories Python and
   the system need, writing only beneath the working directory (and /dev/null); from
   Landlock ABI 4 no TCP bind or connect; from ABI 6 no signals to, and no abstract
   sockets of, processes outside the sandbox.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # x86-64 and arm64 alike
_PR_SET_NO_NEW_PRIVS, _PR_CAPBSET_DROP = 38, 24
_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_RULE_PATH_BENEATH = 1
_CAPABILITY_VERSION_3 = 0x20080522

_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_REMOVE_DIR, _FS_REMOVE_FILE = 1 << 4, 1 << 5
_FS_MAKE_ALL = sum(1 << bit for bit in range(6, 13))  # char, dir, regular, socket, fifo, block, symlink
_FS_REFER, _FS_TRUNCATE = 1 << 13, 1 << 14
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1

_libc = ctypes.CDLL(None, use_errno=True)


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: none)."""
    version = _libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(0, version)


def _read_access() -> int:
    return _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR


def _write_access(abi: int) -> int:
    access = _FS_WRITE_FILE | _FS_REMOVE_DIR | _FS_REMOVE_FILE | _FS_MAKE_ALL
    if abi >= 2:
        access |= _FS_REFER
    if abi >= 3:
        access |= _FS_TRUNCATE
    return access


def restrict_with_landlock(readable: list[str], writable: list[str]) -> list[str]:
    """Allow reading beneath `readable` and writing beneath `writable` only; deny TCP and, where
    the ABI has them, outside signals and abstract sockets. Returns what holds."""
    abi = landlock_abi()
    if abi < 1:
        return []
    read, write = _read_access(), _write_access(abi)
    fields, held = [read | write], ["files"]
    if abi >= 4:
        fields.append(_NET_BIND_TCP | _NET_CONNECT_TCP)
        held.append("tcp")
    if abi >= 6:
        fields.append(_SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL)
        held.append("signals")
    attr = (ctypes.c_uint64 * len(fields))(*fields)
    ruleset = _libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)),
                            ctypes.c_uint32(0))
    if ruleset < 0:
        return []
    for paths, access in ((readable, read), (writable, read | write)):
        for path in paths:
            _add_rule(ruleset, path, access, abi)
    _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    restricted = _libc.syscall(_SYS_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) == 0
    os.close(ruleset)
    return held if restricted else []


def _add_rule(ruleset: int, path: str, access: int, abi: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return
    if not os.path.isdir(path):  # a file takes only file rights (/dev/null is written, never made into)
        access &= _FS_EXECUTE | _FS_READ_FILE | _FS_WRITE_FILE | (_FS_TRUNCATE if abi >= 3 else 0)
    rule = _PathBeneath(access, fd)
    _libc.syscall(_SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0))
    os.close(fd)


def _limit(kind: int, value: int) -> None:
    resource.setrlimit(kind, (value, value))


def _drop_capabilities() -> None:
    """As root: no capability left, in any set, for this process and what it executes."""
    for capability in range(64):
        _libc.prctl(_PR_CAPBSET_DROP, capability, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    _libc.capset(header, data)


def _processes_of(uid: int) -> int:
    """How many tasks (threads included, as the kernel counts them) run under `uid`."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                count += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return count


def _apply(settings: dict) -> None:
    resource.setrlimit(resource.RLIMIT_CPU, (settings["cpu_s"], settings["cpu_s"] + 1))  # SIGXCPU, then SIGKILL
    _limit(resource.RLIMIT_AS, settings["memory_bytes"])
    _limit(resource.RLIMIT_FSIZE, settings["file_bytes"])
    _limit(resource.RLIMIT_NOFILE, settings["open_files"])
    _limit(resource.RLIMIT_CORE, 0)
    root = os.geteuid() == 0
    if settings.get("cgroup"):
        with open(os.path.join(settings["cgroup"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    elif not root:
        _limit(resource.RLIMIT_NPROC, _processes_of(os.getuid()) + settings["processes"])
    _libc.unshare(_CLONE_NEWNET if root else _CLONE_NEWUSER | _CLONE_NEWNET)  # failing: Landlock's TCP rule stays
    if root:
        _drop_capabilities()
    restrict_with_landlock(settings["readable"], [settings["workdir"], "/dev/null"])


def main() -> None:
    separator = sys.argv.index("--")
    settings = json.loads(sys.argv[1])
    argv = sys.argv[separator + 1:]
    _apply(settings)
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main()
