"""What the code sandbox costs per run, beside the same program run bare, in one invocation.

    .venv/bin/python benchmarks/sandbox.py              # 100 runs of each, 20 code_exec scores
    .venv/bin/python benchmarks/sandbox.py --runs 200

Prints runs per second of a trivial program (`print(1)`) started bare (`python -I -B main.py`
in a fresh directory: the floor of any sandbox that starts a Python process per run) and
through `run_python`, their ratio, the launcher's mean seconds per layer, and the `code_exec`
reward's throughput on a three-case problem (test cases per second), all one after another
on the same machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

from rlsys.rewards.code_exec import code_exec
from rlsys.sandbox.local import run_python

PROGRAM = "print(1)\n"
SOLUTION = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
CASES = {"inputs": ["1 2\n", "3 4\n", "5 6\n"], "outputs": ["3\n", "7\n", "11\n"]}


def bare_run() -> None:
    workdir = tempfile.mkdtemp(prefix="bench-bare-")
    try:
        with open(os.path.join(workdir, "main.py"), "w") as f:
            f.write(PROGRAM)
        subprocess.run([sys.executable, "-I", "-B", "main.py"], cwd=workdir, capture_output=True, check=True,
                       env={"PATH": "/usr/bin:/bin"})
    finally:
        shutil.rmtree(workdir)


def per_second(run, count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        run()
    return count / (time.perf_counter() - started)


def layer_costs(count: int) -> dict[str, float]:
    """Mean seconds the launcher spent on each layer (where the sandbox reports them)."""
    costs: dict[str, list[float]] = defaultdict(list)
    for _ in range(count):
        result = run_python(PROGRAM)
        assert result.ok, result
        for name, seconds in (getattr(result, "layers", None) or {}).items():
            costs[name].append(seconds)
    return {name: statistics.mean(values) for name, values in costs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--scores", type=int, default=20)
    args = parser.parse_args()
    run_python(PROGRAM)  # the probe and the compiled filter, once per process
    bare = per_second(bare_run, args.runs)
    sandboxed = per_second(lambda: run_python(PROGRAM), args.runs)
    scores = per_second(lambda: code_exec("code", SOLUTION, CASES), args.scores)
    print(f"{'trivial program, bare':<34} {bare:8.1f} runs/s")
    print(f"{'trivial program, sandboxed':<34} {sandboxed:8.1f} runs/s  ({sandboxed / bare:.2f}x bare)")
    print(f"{'code_exec, 3 cases':<34} {scores * len(CASES['inputs']):8.1f} cases/s")
    costs = layer_costs(min(args.runs, 50))
    if costs:
        print("launcher's mean ms per layer: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in costs.items()))


if __name__ == "__main__":
    main()
