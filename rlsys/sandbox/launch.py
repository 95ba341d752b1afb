"""The sandbox's launcher: `python -I -S launch.py SETTINGS -- ARGV...`, started by
`rlsys.sandbox.local.run_python`. It confines a fresh, single-threaded process tree, then
executes the program in it. It imports nothing of rlsys (only its sibling modules, which use
the standard library), nor json (a tenth of a run's time): the settings come as a `marshal`led
dict in hex, the report goes out as Python literals, one per line.

Three processes, each applying the layers that belong to it:
1. the launcher joins the run's cgroups (memory and process budget) and unshares the mount,
   PID, network, IPC, UTS and cgroup namespaces (through a user namespace without root);
2. its child is PID 1 of the new PID namespace, the run's init: it builds the run's root
   file system (`rootfs`), forks the program's process, reaps every orphan, and reports the
   program's exit status; when it ends, the kernel kills whatever is left in the namespace;
3. the program's process sets its resource limits, becomes an unprivileged user, confines
   itself with Landlock and the seccomp filter, and executes the program.

Every layer is reported, held or with why not, as one line on the report file descriptor;
`require` refuses to execute the program when one is missing, and `probe` stops there either
way (`rlsys.sandbox.local.layers`).
"""

from __future__ import annotations

import marshal
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import confine  # noqa: E402  (siblings, found through the line above)
import landlock  # noqa: E402
import rootfs  # noqa: E402

REFUSED = 126
"""The program's process's exit code when a required layer is missing."""


class Reporter:
    """Writes the run's report: one dict literal per line. Its copies in the forked processes
    share the descriptor (closed when the program is executed) and the layers missing so far."""

    def __init__(self, fd: int):
        self.fd = fd
        self.missing: dict[str, str] = {}
        self.started = time.perf_counter()

    def layer(self, name: str, why: str) -> None:
        """`name` holds when `why` is empty; the seconds since the last report are its cost."""
        now = time.perf_counter()
        self._write({"layer": name, "why": why, "s": now - self.started})
        self.started = now
        if why:
            self.missing[name] = why

    def write(self, **fields) -> None:
        self._write(fields)

    def _write(self, record: dict) -> None:
        os.write(self.fd, (repr(record) + "\n").encode())


def main() -> None:
    separator = sys.argv.index("--")
    settings, argv = marshal.loads(bytes.fromhex(sys.argv[1])), sys.argv[separator + 1:]
    reporter = Reporter(settings["report_fd"])
    os.set_inheritable(reporter.fd, False)  # the program never holds it
    for name, why in settings["missing"].items():
        reporter.layer(name, why)
    root = os.geteuid() == 0
    for name, path in settings["cgroups"].items():
        reporter.layer(name, confine.join_cgroup(path))
    namespaces = confine.unshare_namespaces(root)
    for name in ("network", "ipc"):
        reporter.layer(name, namespaces)
    init = os.fork()
    if init == 0:
        _run_init(settings, argv, reporter, namespaces, root)
    os.waitpid(init, 0)
    os._exit(0)


def _run_init(settings: dict, argv: list[str], reporter: Reporter, namespaces: str, root: bool) -> None:
    """PID 1 of the run: its root file system, then the program's process and every orphan reaped."""
    try:
        confine.die_with_parent()
        home = _enter_root(settings, reporter, namespaces)
        program = os.fork()
        if program == 0:
            _run_program(settings, argv, reporter, home, root)
        while True:
            pid, status = os.wait()
            if pid == program:
                reporter.write(status=status)
                break
    finally:
        os._exit(0)


def _enter_root(settings: dict, reporter: Reporter, namespaces: str) -> str:
    """The run's own root (the program's home is its working directory), or where there is none,
    the host directory the program was written in."""
    workdir = settings["workdir"]
    why, proc = namespaces, False
    if not why:
        new_root = os.path.join(workdir, "root")
        os.mkdir(new_root, 0o700)
        try:
            proc = rootfs.build_and_enter(new_root, settings["readable"], settings["disk_bytes"], settings["uid"],
                                          settings["gid"], os.path.join(workdir, rootfs.PROGRAM))
        except OSError as err:
            why = f"building the run's root file system: {err}"
    reporter.layer("mount", why)
    reporter.layer("pid", why or ("" if proc else "no /proc of its own could be mounted"))
    if why:
        os.chown(workdir, settings["uid"], settings["gid"])
        return workdir
    return rootfs.HOME


def _run_program(settings: dict, argv: list[str], reporter: Reporter, home: str, root: bool) -> None:
    try:
        os.chdir(home)
        confine.stdin_in_memory()
        confine.limit_resources(settings)
        reporter.layer("user", confine.become_unprivileged(settings["uid"], settings["gid"], root))
        own_root = home == rootfs.HOME
        tmp = "/tmp" if own_root else home
        writable = [home, tmp, "/dev/shm", "/dev/null"] if own_root else [home, "/dev/null"]
        reporter.layer("landlock", landlock.restrict(settings["readable"] + ["/etc", "/dev", "/proc"], writable))
        seccomp = bytes.fromhex(settings["seccomp"])
        reporter.layer("seccomp", confine.install_seccomp(seccomp) if seccomp else "no filter was compiled")
        if settings["probe"]:
            os._exit(0)
        if settings["require"] and reporter.missing:
            reporter.write(refused=reporter.missing)
            os._exit(REFUSED)
        env = dict(settings["env"], HOME=home, TMPDIR=tmp)
        os.execve(argv[0], argv, env)
    except BaseException as err:  # noqa: BLE001  (whatever failed, the program does not run)
        reporter.write(launch_error=f"{type(err).__name__}: {err}")
    os._exit(REFUSED)


if __name__ == "__main__":
    main()
