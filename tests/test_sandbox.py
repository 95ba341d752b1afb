"""The code sandbox contains what a model's program can do wrong, and the `code_exec` reward
and `python` tool score and run code through it."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import socket
import threading

import pytest

from rlsys.sandbox.local import SandboxLimits, guarantees, run_python

LIMITS = SandboxLimits(wall_s=3.0, cpu_s=2, memory_mb=512, processes=16)


def sandboxed_processes() -> list[str]:
    """Processes still running in a sandbox's environment."""
    left = []
    for proc in glob.glob("/proc/[0-9]*"):
        try:
            with open(f"{proc}/environ", "rb") as f:
                if b"rlsys-sandbox-" in f.read():
                    left.append(proc)
        except OSError:
            continue
    return left


def test_the_machine_gives_every_guarantee():
    """On these machines (root, Linux 6.18) every layer holds; elsewhere `guarantees` says which."""
    assert all(guarantees().values()), guarantees()


def test_a_program_runs_and_reads_its_input():
    result = run_python("import sys\nprint(sum(map(int, sys.stdin.read().split())))", "3 4 5", LIMITS)
    assert (result.status, result.stdout) == ("ok", "12\n")


@pytest.mark.parametrize(("code", "status", "message"), [
    ("while True: pass", "timeout", ""),  # the CPU limit
    ("import time\ntime.sleep(60)", "timeout", ""),  # the wall limit
    ("x = bytearray(10 * 1024**3)", "error", "MemoryError"),
    ("open('/tmp/escaped.txt', 'w').write('x')", "error", "PermissionError"),
    ("print(open(os.path.expanduser('~root') + '/.bashrc').read())", "error", "Error"),
    ("import socket\nsocket.create_connection(('127.0.0.1', PORT), timeout=2)", "error", "Error"),
    ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", "timeout", ""),
    ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent')", "ok", ""),
], ids=["infinite-loop", "sleep", "10GB", "write-outside", "read-outside", "network", "fork-bomb",
        "escape-session"])
def test_what_a_program_may_not_do_is_refused_or_killed(code, status, message):
    with socket.socket() as server:  # a port that accepts, had the sandbox the network
        server.bind(("127.0.0.1", 0))
        server.listen()
        accepted = []
        threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
        result = run_python("import os\n" + code.replace("PORT", str(server.getsockname()[1])), "", LIMITS)
    assert result.status == status, result
    assert message in result.stderr
    assert result.wall_s < LIMITS.wall_s + 2
    assert not accepted and not os.path.exists("/tmp/escaped.txt")
    assert sandboxed_processes() == []  # nothing the program started is left running


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
