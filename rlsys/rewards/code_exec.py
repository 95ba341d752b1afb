"""`code_exec`: the response's program run against test cases in the sandbox.

The program is the last fenced code block of the response (```python ... ```), or the whole
response without one. The ground truth holds the test cases as VeRL's code data stores them
(a dict, or its JSON string): standard input and expected output per case,

    {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}

or, with `fn_name`, the arguments of a call to that function and its expected return value
(each a JSON list of arguments / a JSON value). The score is 1.0 when every case passes and
0.0 otherwise; `continuous: true` (in the term's kwargs) gives the fraction of cases passed,
as VeRL's `continuous` option does. A case passes when its run exits cleanly and its output,
stripped of trailing whitespace line by line, equals the expected one. `sandbox_url` runs the
cases on a Sandbox Fusion server (its `run_code` API) instead of this machine; without it,
a machine that cannot give every layer of the local sandbox refuses the term before the run
starts, unless `allow_weaker: true`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from rlsys.rewards.registry import register_reward
from rlsys.sandbox.fusion import run_remote
from rlsys.sandbox.local import SandboxLimits, SandboxResult, require_isolation, run_python

_FENCE = re.compile(r"```(?:python|py)?[^\n]*\n(.*?)```", re.DOTALL)
_CALL_TEMPLATE = """
import json as _json, sys as _sys
_args = _json.loads(_sys.stdin.read())
_result = {fn_name}(*_args)
print(_json.dumps(_result))
"""


@register_reward("code_exec")
def code_exec(data_source, solution_str, ground_truth, extra_info=None, continuous: bool = False,
              timeout_s: float = 10.0, memory_mb: int = 1024, sandbox_url: str = "",
              allow_weaker: bool = False) -> dict:
    tests = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    program = extract_program(solution_str)
    limits = _limits(timeout_s, memory_mb, allow_weaker)
    cases = _cases(tests, program)
    passed = sum(_passes(_run(code, stdin, limits, sandbox_url), expected) for code, stdin, expected in cases)
    fraction = passed / len(cases) if cases else 0.0
    return {"score": fraction if continuous else float(bool(cases) and passed == len(cases)), "pass_rate": fraction}


def check_kwargs(kwargs: dict) -> None:
    """Before the run: the local sandbox holds every layer, or the term accepts weaker isolation."""
    if not kwargs.get("sandbox_url"):
        require_isolation(SandboxLimits(allow_weaker=bool(kwargs.get("allow_weaker", False))))


code_exec.check_kwargs = check_kwargs


def _limits(timeout_s: float, memory_mb: int, allow_weaker: bool) -> SandboxLimits:
    return SandboxLimits(wall_s=timeout_s, cpu_s=int(timeout_s) + 1, memory_mb=memory_mb, allow_weaker=allow_weaker)


def extract_program(response: str) -> str:
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def _cases(tests: dict, program: str) -> list[tuple[str, str, str]]:
    """(code, stdin, expected stdout) per test case."""
    inputs, outputs = tests.get("inputs", []), tests.get("outputs", [])
    if tests.get("fn_name"):
        code = program + _CALL_TEMPLATE.format(fn_name=tests["fn_name"])
        return [(code, _json_text(args), json.dumps(_json_value(expected)))
                for args, expected in zip(inputs, outputs)]
    return [(program, str(stdin), str(expected)) for stdin, expected in zip(inputs, outputs)]


def _json_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _json_value(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _run(code: str, stdin: str, limits: SandboxLimits, sandbox_url: str) -> SandboxResult:
    return run_remote(sandbox_url, code, stdin, limits) if sandbox_url else run_python(code, stdin, limits)


def _passes(result: SandboxResult, expected: str) -> bool:
    return result.ok and _normalized(result.stdout) == _normalized(expected)


def _normalized(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())
