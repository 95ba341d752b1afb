"""The sandbox's seccomp filter, compiled by libseccomp (its Python binding where installed,
else pyseccomp, the same API over ctypes) into the classic BPF the launcher loads.

Every system call is allowed but those a sandboxed program never needs, which fail with
EPERM:
- new namespaces: unshare, setns, and clone with a CLONE_NEW* flag (clone3, whose flags sit
  in memory a filter cannot read, answers ENOSYS, so the C library falls back to clone);
- mounts: mount, umount2, pivot_root, chroot and the new mount API;
- other processes: ptrace, process_vm_readv/writev, kcmp, pidfd_getfd;
- kernel surfaces: bpf, perf_event_open, userfaultfd, io_uring (its requests would not pass
  through this filter), the key calls, modules, kexec, reboot, swap, acct, syslog, ...;
- io_setup: kernel AIO contexts are one budget for the whole machine;
- `socket` of any family but IPv4 and IPv6: no Unix socket to connect by path or abstract
  name, no netlink, packet, vsock or any other; `socketpair` of Unix sockets only
  (multiprocessing uses it). A filter cannot tell a socket's family at bind or connect, so a
  socketpair's socket could still bind a name: only the run's own namespaces would see it.
A system call made through another ABI (32-bit x86 or x32 on x86-64) kills the process, so
none of the above can be reached through other numbers.
"""

from __future__ import annotations

import errno
import functools
import socket
import tempfile

_CLONE_NEW_FLAGS = (0x00000080, 0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
"""CLONE_NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET."""
_REFUSED = (
    "unshare", "setns",
    "mount", "umount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount",
    "open_tree", "mount_setattr",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key", "init_module", "finit_module", "delete_module", "kexec_load",
    "kexec_file_load", "reboot", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd", "lookup_dcookie", "syslog",
    "uselib", "vhangup", "open_by_handle_at", "name_to_handle_at", "fanotify_init", "io_setup",
)
_SOCKET_FAMILIES = (socket.AF_INET, socket.AF_INET6)
_LARGEST_FAMILY = 64


@functools.cache
def compiled() -> tuple[bytes, str]:
    """The filter as BPF, and "" or why there is none (no libseccomp binding, no libseccomp)."""
    try:
        seccomp = _binding()
    except (ImportError, OSError, RuntimeError) as err:
        return b"", f"no libseccomp binding (pyseccomp over libseccomp.so.2): {err}"
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    rules.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_PROCESS)
    refuse = seccomp.ERRNO(errno.EPERM)
    for name in _REFUSED:
        _add(rules, seccomp, refuse, name)
    for flag in _CLONE_NEW_FLAGS:
        _add(rules, seccomp, refuse, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    _add(rules, seccomp, seccomp.ERRNO(errno.ENOSYS), "clone3")
    for family in range(_LARGEST_FAMILY):
        if family not in _SOCKET_FAMILIES:
            _add(rules, seccomp, refuse, "socket", seccomp.Arg(0, seccomp.EQ, family))
    _add(rules, seccomp, refuse, "socket", seccomp.Arg(0, seccomp.GE, _LARGEST_FAMILY))
    _add(rules, seccomp, refuse, "socketpair", seccomp.Arg(0, seccomp.NE, socket.AF_UNIX))
    with tempfile.TemporaryFile() as out:
        rules.export_bpf(out)
        out.seek(0)
        return out.read(), ""


def _binding():
    try:
        import seccomp  # libseccomp's own binding (e.g. Debian's python3-seccomp)
    except ImportError:
        import pyseccomp as seccomp
    return seccomp


def _add(rules, seccomp, action: int, name: str, *args) -> None:
    """A rule for `name`; a system call this architecture (or this libseccomp) does not know needs none."""
    if seccomp.resolve_syscall(seccomp.Arch.NATIVE, name) >= 0:
        rules.add_rule(action, name, *args)
