"""The code sandbox holds against hostile programs, each checked from outside: what the
program could reach (files, processes, sockets of every family, namespaces, other ABIs), and
what it could take (memory, disk, processes, time). The `code_exec` reward and the `python`
tool run code through it, and a machine that cannot give a layer refuses unless told to
accept weaker isolation."""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest

from rlsys.sandbox.local import SandboxLimits, layers, run_python

# The quick tier; and one xdist worker runs this module (scripts/test.sh): its checks look at every process
# of the machine (`sandboxed_processes`), so two of its runs must never be in flight at once.
pytestmark = [pytest.mark.quick, pytest.mark.xdist_group("sandbox")]

LIMITS = SandboxLimits(wall_s=30.0, cpu_s=2, memory_mb=512, processes=16)
"""A program that should finish is never decided by the wall limit: a loaded 2-core machine can take
seconds to start Python."""
TIMED = dataclasses.replace(LIMITS, wall_s=3.0)
"""For a program the limits must stop: the wall limit is what ends a sleeping one."""


def sandboxed_processes() -> list[str]:
    """Processes still running in another PID namespace or a run's environment."""
    mine, left = os.readlink("/proc/self/ns/pid"), []
    for proc in glob.glob("/proc/[0-9]*"):
        try:
            with open(f"{proc}/environ", "rb") as f:
                marked = b"rlsys-sandbox-" in f.read()
            if marked or os.readlink(f"{proc}/ns/pid") != mine:
                left.append(proc)
        except OSError:
            continue
    return left


def shared_memory_mb() -> float:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Shmem:")) / 1024


class Listener:
    """A server the sandbox must not reach: it records every connection it accepts."""

    def __init__(self, family: int, address):
        self.server = socket.socket(family, socket.SOCK_STREAM)
        self.server.bind(address)
        self.server.listen()
        self.accepted: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        try:
            while True:
                self.accepted.append(self.server.accept())
        except OSError:
            return

    def close(self) -> None:
        self.server.close()


def test_every_layer_holds_on_this_machine():
    """As root on Linux 6.18 with Landlock ABI 7 and cgroup v1 pids and memory: all of them."""
    missing = {name: why for name, why in layers().items() if why}
    assert missing == {}


def test_a_program_runs_and_reads_its_input():
    result = run_python("import sys\nprint(sum(map(int, sys.stdin.read().split())))", "3 4 5", LIMITS)
    assert (result.status, result.stdout) == ("ok", "12\n")
    assert set(result.layers) >= {"mount", "pid", "network", "user", "landlock", "seccomp", "memory", "pids"}


@pytest.mark.parametrize(("code", "status", "message"), [
    ("while True: pass", "timeout", ""),  # the CPU limit
    ("import time\ntime.sleep(60)", "timeout", ""),  # the wall limit
    ("x = bytearray(10 * 1024**3)", "error", "MemoryError"),
    ("import socket\nsocket.create_connection(('127.0.0.1', PORT), timeout=2)", "error", "Error"),
    ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", "timeout", ""),
    ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent')", "ok", ""),
    ("open('big', 'wb').write(b'x' * (17 << 20))", "error", "File too large"),
], ids=["infinite-loop", "sleep", "10GB", "tcp-to-the-host", "fork-bomb", "escape-session", "file-size"])
def test_what_a_program_may_not_do_is_refused_or_killed(code, status, message):
    listener = Listener(socket.AF_INET, ("127.0.0.1", 0))
    try:
        result = run_python(code.replace("PORT", str(listener.server.getsockname()[1])), "",
                            TIMED if status == "timeout" else LIMITS)
    finally:
        listener.close()
    assert result.status == status, result
    assert message in result.stderr
    assert result.wall_s < LIMITS.wall_s + 2
    assert not listener.accepted
    assert sandboxed_processes() == []  # nothing the program started is left running


def test_no_unix_socket_of_the_machine_is_reachable(tmp_path):
    """Ray's dashboard answers on a Unix socket without its token: a program that finds a socket's
    path in another process's command line, or by name in the abstract namespace, reaches nothing."""
    os.chmod(tmp_path, 0o777)
    path = str(tmp_path / "dash_JobHead")
    abstract = f"\0rlsys-test-{uuid.uuid4().hex}"
    by_path, by_name = Listener(socket.AF_UNIX, path), Listener(socket.AF_UNIX, abstract)
    os.chmod(path, 0o777)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", path])  # the path in a cmdline
    hostile = f"""
import glob, socket
paths = {{{path!r}}}
for cmdline in glob.glob('/proc/*/cmdline'):
    try:
        paths.update(p for p in open(cmdline).read().split('\\0') if 'dash_' in p)
    except OSError:
        pass
for address in sorted(paths) + [{abstract!r}]:
    try:
        s = socket.socket(socket.AF_UNIX)
        s.connect(address)
        print('reached', address)
    except OSError as err:
        print('refused', type(err).__name__)
"""
    try:
        result = run_python(hostile, "", LIMITS)
    finally:
        holder.kill()
        by_path.close()
        by_name.close()
    assert result.ok, result
    assert "reached" not in result.stdout and "PermissionError" in result.stdout
    assert by_path.accepted == [] and by_name.accepted == []


@pytest.mark.parametrize(("family", "kind"), [("AF_UNIX", "SOCK_STREAM"), ("AF_NETLINK", "SOCK_DGRAM"),
                                            ("AF_PACKET", "SOCK_RAW"), ("AF_VSOCK", "SOCK_STREAM"),
                                            ("AF_ALG", "SOCK_SEQPACKET")])
def test_sockets_of_families_other_than_inet_are_refused(family, kind):
    """A Unix socket could reach a service by path, vsock the virtual machine's host (no network
    namespace holds it), netlink and packet sockets the kernel's network surfaces."""
    result = run_python(f"import socket\nsocket.socket(socket.{family}, socket.{kind})\nprint('created')", "", LIMITS)
    assert result.status == "error" and "created" not in result.stdout
    assert "Operation not permitted" in result.stderr


def test_a_run_sees_and_reaches_only_its_own_processes():
    marker = f"rlsys-marker-{uuid.uuid4().hex}"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", marker])
    hostile = f"""
import glob, json, os
seen = {{}}
for proc in glob.glob('/proc/[0-9]*'):
    try:
        seen[proc] = open(proc + '/cmdline').read()
    except OSError:
        pass
try:
    os.kill({other.pid}, 0)
    reach = 'signalled'
except OSError as err:
    reach = type(err).__name__
print(json.dumps({{'seen': seen, 'reach': reach}}))
"""
    try:
        result = run_python(hostile, "", LIMITS)
    finally:
        other.kill()
        other.wait()
    assert result.ok, result
    found = json.loads(result.stdout)
    assert marker not in result.stdout and "pytest" not in result.stdout
    assert len(found["seen"]) <= 2  # the program (and its own children): not even the run's init
    assert found["reach"] == "ProcessLookupError"


def test_the_program_runs_as_a_user_that_owns_nothing():
    """A file only its owner (root) may read, in a directory the run can read: refused."""
    secret = uuid.uuid4().hex
    fd, path = tempfile.mkstemp(prefix="rlsys-secret-", dir=sys.prefix)
    try:
        os.write(fd, secret.encode())
        os.close(fd)
        os.chmod(path, 0o600)
        result = run_python(f"import os\nprint(os.getuid())\nprint(open({path!r}).read())", "", LIMITS)
    finally:
        os.remove(path)
    assert secret not in result.stdout
    assert result.stdout.split()[0] != "0" and "PermissionError" in result.stderr


def test_no_new_namespaces_and_no_mounts():
    """Namespaces a program creates itself would open the kernel's user-namespace surface."""
    hostile = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for name, flag in (('user', 0x10000000), ('mount', 0x20000), ('net', 0x40000000)):
    print(name, libc.unshare(flag), os.strerror(ctypes.get_errno()))
print('mount', libc.mount(b'none', b'/tmp', b'tmpfs', 0, None), os.strerror(ctypes.get_errno()))
import subprocess
print('unshare-tool', subprocess.run(['unshare', '--user', 'true'], capture_output=True).returncode)
"""
    result = run_python(hostile, "", LIMITS)
    assert result.ok, result
    lines = result.stdout.splitlines()
    assert lines[:4] == [f"{name} -1 Operation not permitted" for name in ("user", "mount", "net", "mount")]
    assert lines[4] != "unshare-tool 0"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the 32-bit ABI of x86-64")
def test_a_system_call_through_the_32_bit_abi_kills_the_program():
    """int 0x80 reaches the i386 system calls, which a filter of x86-64 numbers would let through."""
    hostile = """
import ctypes, mmap
code = bytes([0xb8, 20, 0, 0, 0, 0xcd, 0x80, 0xc3])  # mov eax, 20 (i386 getpid); int 0x80; ret
page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(code)
call = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
print('before', flush=True)
print('after', call())
"""
    result = run_python(hostile, "", LIMITS)
    assert result.stdout == "before\n" and result.status == "killed", result


def test_one_memory_budget_for_all_of_a_runs_processes():
    """Four processes of 160 MB each, holding it at once, against a 384 MB budget: at most two
    keep theirs to the end (the kernel kills the others). They hold it until each of them has either
    written all its pages or been killed (the program waits on that, not on a clock), so a loaded
    machine's slowness changes nothing but the wall time, whose limit is generous for that reason."""
    hostile = """
import os, select, struct
ready_r, ready_w = os.pipe()
go_r, go_w = os.pipe()
children = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        os.close(ready_r); os.close(go_w)
        block = bytearray(b'\\x01') * (160 << 20)  # every page written
        os.write(ready_w, struct.pack('i', os.getpid()))
        os.read(go_r, 1)  # held until the parent lets go
        os._exit(0)
    children.append(pid)
os.close(ready_w); os.close(go_r)
settled, status = set(), {}
while len(settled) < len(children):  # each child has its pages, or is dead
    if select.select([ready_r], [], [], 0.1)[0]:
        data = os.read(ready_r, 4)
        if data:
            settled.add(struct.unpack('i', data)[0])
    for pid in children:
        if pid not in status and os.waitpid(pid, os.WNOHANG)[0]:
            status[pid] = 'killed'
            settled.add(pid)
os.close(go_w)
print(sum(os.waitpid(pid, 0)[1] == 0 for pid in children if pid not in status))
"""
    # wall_s: the time a loaded 2-core machine can take to start Python and fault in 640 MB; the budget
    # checked here is memory's
    result = run_python(hostile, "", SandboxLimits(wall_s=120.0, cpu_s=5, memory_mb=384, processes=16))
    assert result.ok, result
    assert 1 <= int(result.stdout) <= 2, result


def test_one_disk_budget_for_a_runs_files():
    """Files in its home, /tmp and /dev/shm share one budget; nothing is left on the machine."""
    hostile = """
import os
written = 0
for directory in ('.', '/tmp', '/dev/shm'):
    for i in range(64):
        try:
            with open(os.path.join(directory, f'f{i}'), 'wb') as f:
                f.write(b'x' * (4 << 20))
            written += 4
        except OSError:
            break
print(written)
"""
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "rlsys-sandbox-*")))
    result = run_python(hostile, "", SandboxLimits(wall_s=8.0, cpu_s=5, disk_mb=32))
    assert result.ok, result
    assert 0 < int(result.stdout) <= 32
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "rlsys-sandbox-*"))) <= before


def test_one_cpu_budget_for_all_of_a_runs_processes():
    """Two busy processes for a second of wall time against half a CPU: the kernel's count of their
    CPU time."""
    hostile = """
import os, time
for _ in range(2):
    if os.fork() == 0:
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            pass
        os._exit(0)
os.wait()
os.wait()
times = os.times()
print(times.children_user + times.children_system)
"""
    result = run_python(hostile, "", SandboxLimits(wall_s=8.0, cpu_s=5, cpus=0.5))
    assert result.ok, result
    assert float(result.stdout) < 0.5 * 1.0 + 0.25


def test_files_hidden_in_a_socket_cycle_do_not_outlive_the_run():
    """Memfds sent into a cycle of Unix sockets that carry each other, then every descriptor closed:
    only the kernel's collector frees them, which runs when some Unix socket closes."""
    hostile = """
import os, socket
fds = []
for _ in range(8):
    fd = os.memfd_create('held')
    os.write(fd, b'q' * (16 << 20))
    fds.append(fd)
a, b = socket.socketpair()
socket.send_fds(a, [b'x'], [a.fileno(), b.fileno()] + fds)
for fd in fds:
    os.close(fd)
print('hidden')
"""
    before = shared_memory_mb()
    result = run_python(hostile, "", SandboxLimits(wall_s=5.0, memory_mb=512))
    assert result.stdout == "hidden\n", result
    for _ in range(50):  # the collector runs on the kernel's work queue
        if shared_memory_mb() < before + 64:
            break
        time.sleep(0.05)
    assert shared_memory_mb() < before + 64


def test_a_caller_confined_by_its_cgroup_stays_confined_with_its_runs(tmp_path):
    """A run's cgroups sit beneath the caller's: 300 MB in a run of a caller held to 200 MB fails."""
    cgroup = f"/sys/fs/cgroup/memory/rlsys-test-caller-{uuid.uuid4().hex[:8]}"
    os.mkdir(cgroup)
    try:
        with open(f"{cgroup}/memory.limit_in_bytes", "w") as f:
            f.write(str(200 << 20))
        caller = f"""
import os
open({cgroup!r} + '/cgroup.procs', 'w').write(str(os.getpid()))
from rlsys.sandbox.local import SandboxLimits, run_python
result = run_python("block = bytearray(b'1') * (300 << 20)\\nprint('held')", limits=SandboxLimits(memory_mb=512))
print(result.status, result.stdout.strip())
"""
        done = subprocess.run([sys.executable, "-c", caller], capture_output=True, text=True, timeout=60)
    finally:
        os.rmdir(cgroup)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == "killed" and "held" not in done.stdout


def test_a_caller_with_many_open_files_and_a_program_reading_dev_stdin():
    """A trainer may hold over a thousand descriptors; a program may read its input as a file."""
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        result = run_python("print(open('/dev/stdin').read().upper())", "input", LIMITS)
    finally:
        for fd in held:
            os.close(fd)
    assert (result.status, result.stdout) == ("ok", "INPUT\n"), result


def test_runaway_native_recursion_fails_fast():
    """The caller's stack limit may be unlimited (some launchers set it): the run has its own."""
    soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
    resource.setrlimit(resource.RLIMIT_STACK, (hard, hard))
    try:
        code = ("import sys\nsys.setrecursionlimit(10**9)\n"
                "class A:\n    def __repr__(self):\n        return repr(self)\nrepr(A())")
        result = run_python(code, "", SandboxLimits(wall_s=10.0, cpu_s=10))
    finally:
        resource.setrlimit(resource.RLIMIT_STACK, (soft, hard))
    assert result.status == "killed" and result.wall_s < 3, result


def test_without_root_the_missing_layers_refuse_unless_weaker_is_accepted():
    """As a user without root (here: uid 1000 in a user namespace) there are no cgroups and no other
    uid: a run refuses naming the layer, and so does the configuration of a `python` tool or a
    `code_exec` term (one line naming the key); with allow_weaker the other layers still hold."""
    probe = """
import json
from rlsys.config.loader import ConfigError
from rlsys.config.rl import RewardTerm
from rlsys.rewards.loading import resolve_term
from rlsys.sandbox.local import SandboxLimits, SandboxUnavailable, layers, run_python
from rlsys.tools.registry import load_tools
import rlsys.tools
out = {'missing': sorted(name for name, why in layers().items() if why)}
try:
    run_python('print(1)')
except SandboxUnavailable as err:
    out['run'] = str(err)
for key, check in (('tool', lambda weaker: load_tools(['python'], '', configs={'python': weaker})),
                   ('reward', lambda weaker: resolve_term(RewardTerm(name='code_exec', kwargs=weaker),
                                                          'reward.terms[0]'))):
    try:
        check({})
    except ConfigError as err:
        out[key] = str(err)
    check({'allow_weaker': True})
result = run_python('import socket\\ns = socket.socket(socket.AF_UNIX)', limits=SandboxLimits(allow_weaker=True))
out['unix'] = result.stderr.strip().splitlines()[-1]
print(json.dumps(out))
"""
    done = subprocess.run(["unshare", "--user", "--map-user=1000", "--map-group=1000", sys.executable, "-c", probe],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["missing"] == ["cpu", "memory", "pids", "user"]
    assert "the code sandbox's memory layer is missing on this machine: not root" in found["run"]
    assert found["tool"].startswith("tools.names[0]: tool 'python' cannot be built: SandboxUnavailable: the code")
    assert found["reward"].startswith("reward.terms[0].kwargs: SandboxUnavailable: the code sandbox's memory layer")
    assert "\n" not in found["tool"] + found["reward"]
    assert "Operation not permitted" in found["unix"]


def test_code_exec_scores_all_pass_or_the_fraction_of_cases():
    from rlsys.rewards.code_exec import code_exec

    tests = {"inputs": ["1 2\n", "3 4\n", "5 6\n"], "outputs": ["3\n", "7\n", "11\n"]}
    right = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    wrong_on_one = "```python\na, b = map(int, input().split())\nprint(a + b if a < 5 else 0)\n```"
    assert code_exec("code", right, json.dumps(tests))["score"] == 1.0
    assert code_exec("code", wrong_on_one, tests)["score"] == 0.0
    assert code_exec("code", wrong_on_one, tests, continuous=True)["score"] == pytest.approx(2 / 3)
    assert code_exec("code", "while True: pass", tests, timeout_s=1.0)["score"] == 0.0
    calls = {"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [3, 7]}
    assert code_exec("code", "def add(a, b):\n    return a + b", calls)["score"] == 1.0


def test_the_python_tool_answers_with_what_the_program_printed():
    from rlsys.tools.builtin import PythonTool

    tool = PythonTool({"wall_s": 3.0})

    async def run(code: str) -> str:
        response, _, _ = await tool.execute("i", {"code": code})
        return response.text

    assert asyncio.run(run("print(2**100)")) == str(2**100) + "\n"
    failed = asyncio.run(run("1/0"))
    assert "ZeroDivisionError" in failed and failed.endswith("[error]")


def test_a_python_environment_reached_through_a_symbolic_link(tmp_path):
    """A venv that is a link to another directory (as conda and shared-venv setups make): the run
    finds its interpreter through the link, and sees nothing of the link's directory but the link."""
    linked = tmp_path / "linked-env"
    linked.symlink_to(os.path.realpath(sys.prefix))
    (tmp_path / "secret.txt").write_text("host")
    code = (f"import os, sys\nprint(sys.prefix, *os.listdir({str(tmp_path)!r}))\n"
            f"try:\n    open({str(tmp_path / 'secret.txt')!r})\nexcept OSError as err:\n    print(type(err).__name__)")
    probe = f"import json\nfrom rlsys.sandbox.local import run_python\nprint(json.dumps(run_python({code!r}).__dict__))"
    done = subprocess.run([str(linked / "bin" / os.path.basename(sys.executable)), "-c", probe],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (result["status"], result["stdout"]) == ("ok", f"{linked} linked-env\nFileNotFoundError\n"), result
