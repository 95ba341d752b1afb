"""The run's own root file system, built by the sandbox's init process inside the run's mount
and PID namespaces, then entered with pivot_root so that nothing of the host's file system is
left in view: none of its files, Unix sockets or devices.

The new root is an empty tmpfs of the run's disk budget. Beneath it: the system's and
Python's directories bound read-only at their own paths, a minimal /etc (the dynamic
loader's cache, the time zone, a passwd naming the run's user), a /dev of null, zero, full,
random and urandom, a /proc of the run's PID namespace, and on the tmpfs itself /tmp,
/dev/shm and the home directory the program runs in: one disk budget for all three.

Imported by the launcher as a sibling module (it runs with `-I -S`): standard library only.
"""

from __future__ import annotations

import ctypes
import os

HOME = "/home/sandbox"
"""The program's home and working directory inside the new root."""
PROGRAM = "main.py"

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME = 1024, 2048, 1 << 21
_ST_RELATIME = 4096
_MNT_DETACH = 2
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime")
_DEVICES = ("null", "zero", "full", "random", "urandom")
_BYTES_PER_INODE = 16384

_libc = ctypes.CDLL(None, use_errno=True)


def build_and_enter(new_root: str, readable: list[str], disk_bytes: int, uid: int, gid: int,
                    program: str) -> bool:
    """Build the root at `new_root` (an empty host directory), copy the `program` file into its
    home, and make it this process's root. Returns whether /proc is mounted (a user namespace
    may refuse a new proc where the host's /proc is partly hidden); raises OSError when the root
    cannot be built."""
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing mounted here reaches the host
    inodes = max(4096, disk_bytes // _BYTES_PER_INODE)
    _mount("tmpfs", new_root, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={disk_bytes},nr_inodes={inodes},mode=755")
    for path in _outermost(readable):
        _bind_read_only(path, new_root + path)
    _make_etc(new_root, uid, gid)
    _make_dev(new_root)
    proc = _mount_proc(new_root)
    for directory in ("/tmp", "/dev/shm"):
        os.makedirs(new_root + directory, exist_ok=True)
        os.chmod(new_root + directory, 0o1777)
    os.makedirs(new_root + HOME, mode=0o700)
    with open(program, "rb") as source, open(os.path.join(new_root + HOME, PROGRAM), "wb") as copy:
        copy.write(source.read())
    os.chown(new_root + HOME, uid, gid)
    _pivot_root(new_root)
    return proc


def _outermost(paths: list[str]) -> list[str]:
    """Each existing path once, with none beneath another (symbolic links, such as /bin -> usr/bin
    on a merged-/usr system, are kept as links and reproduced)."""
    kept: list[str] = []
    for path in sorted({os.path.abspath(p) for p in paths if os.path.lexists(p)}):
        if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(path)
    return kept


def _bind_read_only(source: str, target: str) -> None:
    if os.path.islink(source):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.symlink(os.readlink(source), target)
        return
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "w").close()
    _mount(source, target, None, _MS_BIND)
    # A user namespace may not clear the flags the source mount already has: keep them.
    _mount(None, target, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _flags_of(source))


def _flags_of(path: str) -> int:
    flags = os.statvfs(path).f_flag
    kept = flags & (_MS_NOEXEC | _MS_NOATIME | _MS_NODIRATIME)
    return kept | (_MS_RELATIME if flags & _ST_RELATIME else 0)


def _make_etc(new_root: str, uid: int, gid: int) -> None:
    os.makedirs(new_root + "/etc", mode=0o755)
    for name in _ETC:
        if os.path.lexists(os.path.join("/etc", name)):
            _bind_read_only(os.path.join("/etc", name), new_root + "/etc/" + name)
    with open(new_root + "/etc/passwd", "w") as f:
        f.write(f"root:x:0:0:root:/root:/usr/sbin/nologin\nsandbox:x:{uid}:{gid}:sandbox:{HOME}:/usr/sbin/nologin\n")
    with open(new_root + "/etc/group", "w") as f:
        f.write(f"root:x:0:\nsandbox:x:{gid}:\n")


def _make_dev(new_root: str) -> None:
    dev = new_root + "/dev"
    os.makedirs(dev, mode=0o755)
    for name in _DEVICES:
        open(os.path.join(dev, name), "w").close()
        _mount("/dev/" + name, os.path.join(dev, name), None, _MS_BIND)
    os.symlink("/proc/self/fd", dev + "/fd")
    for number, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{number}", os.path.join(dev, name))


def _mount_proc(new_root: str) -> bool:
    """The PID namespace's /proc, where the kernel allows it showing only the processes of the
    program's own user (not the init that runs as root)."""
    os.makedirs(new_root + "/proc", mode=0o555)
    for options in ("hidepid=invisible", "hidepid=2", None):  # Linux 5.8+, older, none
        try:
            _mount("proc", new_root + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, options)
            return True
        except OSError:
            continue
    return False


def _pivot_root(new_root: str) -> None:
    """Make `new_root` the root and detach the old one (pivot_root(".", ".") stacks the old root
    on the new one, and the lazy unmount takes it away)."""
    machine = os.uname().machine
    number = _SYS_PIVOT_ROOT.get(machine)
    if number is None:
        raise OSError(f"pivot_root: no system call number known for {machine}")
    os.chdir(new_root)
    if _libc.syscall(number, b".", b".") != 0:
        raise _error("pivot_root", new_root)
    if _libc.umount2(b".", _MNT_DETACH) != 0:
        raise _error("umount2", "/")
    os.chdir("/")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def encode(text: str | None) -> bytes | None:
        return text.encode() if text is not None else None

    if _libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)) != 0:
        raise _error("mount", target)


def _error(call: str, path: str) -> OSError:
    number = ctypes.get_errno()
    return OSError(number, f"{call} {path}: {os.strerror(number)}")
