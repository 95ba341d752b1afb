"""Landlock (Linux 5.13+) through its three system calls: reading and executing only beneath
some directories, writing only beneath others; from ABI 4 no TCP bind or connect; from ABI 6
no signal to, and no abstract Unix socket of, a process outside the sandbox.

Imported by the launcher as a sibling module (it runs with `-I -S`), so it uses the standard
library only.
"""

from __future__ import annotations

import ctypes
import os

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # x86-64 and arm64 alike
_PR_SET_NO_NEW_PRIVS = 38
_RULE_PATH_BENEATH = 1
FULL_ABI = 6
"""The ABI that gives every rule the sandbox asks for (files, TCP, signal and socket scoping)."""

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


def abi() -> int:
    """The kernel's Landlock ABI version (0: none)."""
    version = _libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(0, version)


def restrict(readable: list[str], writable: list[str]) -> str:
    """Allow reading beneath `readable` and writing beneath `writable` only; deny TCP and, where
    the ABI has them, outside signals and abstract sockets. Returns "" when every rule holds,
    otherwise why not."""
    version = abi()
    if version < 1:
        return "no Landlock in this kernel (Linux 5.13+ with landlock in the LSM list)"
    read, write = _read_access(), _write_access(version)
    fields = [read | write]
    if version >= 4:
        fields.append(_NET_BIND_TCP | _NET_CONNECT_TCP)
    if version >= 6:
        fields.append(_SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL)
    attr = (ctypes.c_uint64 * len(fields))(*fields)
    ruleset = _libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)),
                            ctypes.c_uint32(0))
    if ruleset < 0:
        return f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}"
    for paths, access in ((readable, read), (writable, read | write)):
        for path in paths:
            _add_rule(ruleset, path, access, version)
    _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    restricted = _libc.syscall(_SYS_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) == 0
    os.close(ruleset)
    if not restricted:
        return f"landlock_restrict_self: {os.strerror(ctypes.get_errno())}"
    if version < FULL_ABI:
        network = "TCP denied" if version >= 4 else "no TCP rule"
        return f"Landlock ABI {version} < {FULL_ABI}: files confined, {network}, no signal or abstract-socket scoping"
    return ""


def _read_access() -> int:
    return _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR


def _write_access(version: int) -> int:
    access = _FS_WRITE_FILE | _FS_REMOVE_DIR | _FS_REMOVE_FILE | _FS_MAKE_ALL
    if version >= 2:
        access |= _FS_REFER
    if version >= 3:
        access |= _FS_TRUNCATE
    return access


def _add_rule(ruleset: int, path: str, access: int, version: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return
    if not os.path.isdir(path):  # a file takes only file rights (/dev/null is written, never made into)
        access &= _FS_EXECUTE | _FS_READ_FILE | _FS_WRITE_FILE | (_FS_TRUNCATE if version >= 3 else 0)
    rule = _PathBeneath(access, fd)
    _libc.syscall(_SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0))
    os.close(fd)
