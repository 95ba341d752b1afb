"""Several `python -m rlsys.run` commands in one process apart from the tests' (whose Ray, if started,
the commands' checks would count, and whose HF_* settings they would inherit): one interpreter start
for all of them. Each command gets its own environment additions and its own stdout and stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys

DRIVER = """
import json, os, sys, tempfile
from rlsys.run import main

def captured(fd, run):
    with tempfile.TemporaryFile(mode="w+") as file:
        sys.stdout.flush(); sys.stderr.flush()
        kept = os.dup(fd)
        os.dup2(file.fileno(), fd)
        try:
            result = run()
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os.dup2(kept, fd)
            os.close(kept)
        file.seek(0)
        return result, file.read()

results = []
for argv, env in json.loads(sys.argv[1]):
    kept_env = dict(os.environ)
    os.environ.update(env)
    (code, err), out = captured(1, lambda: captured(2, lambda: main(argv)))
    os.environ.clear(); os.environ.update(kept_env)
    results.append([code, out, err])
print(json.dumps(results), file=sys.__stdout__)
"""


def run_commands(commands: list[tuple[list[str], dict[str, str]]],
                 timeout_s: float = 300) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of `python -m rlsys.run ARGV` for each (ARGV, environment additions),
    run one after another without RAY_ADDRESS and the user's HF_* settings."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(commands)], capture_output=True, text=True,
                          timeout=timeout_s, env=environment)
    assert done.returncode == 0, done.stderr[-3000:]
    return [tuple(result) for result in json.loads(done.stdout.splitlines()[-1])]
