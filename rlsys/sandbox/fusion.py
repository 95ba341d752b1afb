"""A Sandbox Fusion server (its `run_code` HTTP API) in place of the local sandbox, for users who run
one: the same program, standard input and limits, the same `SandboxResult` back."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from rlsys.sandbox.local import SandboxLimits, SandboxResult

_STATUS = {"Finished": "ok", "TimeLimitExceeded": "timeout"}


def run_remote(url: str, code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """POST the program to `url` (ending in /run_code) and read its run's result; a server that
    cannot be reached or answers with an error is a failed run, never an exception."""
    request = {"code": code, "language": "python", "stdin": stdin, "run_timeout": limits.wall_s,
               "memory_limit_MB": limits.memory_mb}
    started = time.monotonic()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, json.dumps(request).encode(),
                                                           {"Content-Type": "application/json"}),
                                    timeout=limits.wall_s + 30) as response:
            answer = json.loads(response.read())
    except (urllib.error.URLError, TimeoutError, ValueError) as err:
        return SandboxResult("error", None, "", f"sandbox server: {err}", time.monotonic() - started)
    run = answer.get("run_result") or {}
    code_ = run.get("return_code")
    status = _STATUS.get(run.get("status"), "error")
    if status == "ok" and code_ not in (0, None):
        status = "error"
    return SandboxResult(status, code_, run.get("stdout") or "", run.get("stderr") or "",
                         time.monotonic() - started)
