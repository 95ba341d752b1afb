"""VeRL's tool modules, for tool files written for VeRL, where VeRL itself is not installed.

A VeRL tool file imports `verl.tools.base_tool` (`BaseTool`), `verl.tools.schemas` (the OpenAI
schemas, `ToolResponse`), `verl.utils.rollout_trace` (`rollout_trace_op`, the tracing decorator
on `execute`) and, VeRL's GSM8K tool, `verl.utils.reward_score.gsm8k`; VeRL's own tools import
the first two relatively, as modules of `verl.tools`. Where `import verl` finds nothing, these
names resolve to rlsys's equivalents: its `BaseTool` and schemas, a decorator that changes
nothing, and rlsys's GSM8K answer check. A module `verl.tools.<name>` is looked for beside the
tool YAML that names it, so VeRL's `gsm8k_tool.py` and its YAML load as they are.

The finder stands last on `sys.meta_path`: an installed VeRL always comes first, and then its
`BaseTool` subclasses run as they are (rlsys calls them through the same methods). Only the
names above are served; any other `verl.*` import fails as it would without VeRL.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import re
import sys
import types

from rlsys.tools import base

_PACKAGES = ("verl", "verl.tools", "verl.utils", "verl.utils.reward_score")


def rollout_trace_op(func):
    """VeRL's tracing decorator: rlsys traces nothing, so the function stays as it is."""
    return func


def rollout_trace_attr(*args, **kwargs):
    """VeRL's tracing context: nothing to record."""
    return contextlib.nullcontext()


_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
_MARKED_NUMBER = re.compile(r"#### (\-?[0-9\.\,]+)")
_TAIL_CHARS = 300
"""VeRL's GSM8K check reads only the end of a long response, where the answer is."""


def gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The response's answer: the last `#### <number>` (strict), or its last number (flexible)."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', not {method!r}")
    tail = solution_str[-_TAIL_CHARS:]
    if method == "strict":
        marked = _MARKED_NUMBER.findall(tail)
        return marked[-1].replace(",", "").replace("$", "") if marked else None
    numbers = [n for n in _NUMBER.findall(tail) if n not in ("", ".")]
    return numbers[-1] if numbers else None


def gsm8k_score(solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0,
                score: float = 1.0) -> float:
    """VeRL's `gsm8k.compute_score`: `score` for the right answer, `format_score` for another, 0 for none."""
    answer = gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score


_MODULES: dict[str, dict] = {
    "verl.tools.base_tool": {"BaseTool": base.BaseTool},
    "verl.tools.schemas": {name: getattr(base, name) for name in (
        "OpenAIFunctionPropertySchema", "OpenAIFunctionParametersSchema", "OpenAIFunctionSchema",
        "OpenAIFunctionToolSchema", "OpenAIFunctionParsedSchema", "OpenAIFunctionCallSchema",
        "OpenAIFunctionToolCall", "ToolResponse")},
    "verl.utils.rollout_trace": {"rollout_trace_op": rollout_trace_op, "rollout_trace_attr": rollout_trace_attr},
    "verl.utils.reward_score.gsm8k": {"compute_score": gsm8k_score, "extract_solution": gsm8k_answer},
}


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__dict__.update(_MODULES.get(module.__name__, {}))


class VerlCompatFinder(importlib.abc.MetaPathFinder):
    """Serves the VeRL modules above when no installed VeRL does (see the module's docstring)."""

    def find_spec(self, name: str, path, target=None):
        if name not in _MODULES and name not in _PACKAGES:
            return None
        spec = importlib.machinery.ModuleSpec(name, _Loader(), is_package=name in _PACKAGES)
        if name in _PACKAGES:
            spec.submodule_search_locations = []  # verl.tools: the tool YAMLs' directories (`add_tool_dir`)
        return spec


def install() -> None:
    """Put the finder last on sys.meta_path (once)."""
    if not any(isinstance(finder, VerlCompatFinder) for finder in sys.meta_path):
        sys.meta_path.append(VerlCompatFinder())


def add_tool_dir(directory: str) -> None:
    """Let `verl.tools.<name>` find `<name>.py` in `directory` (a tool YAML's), when rlsys serves
    `verl.tools`; an installed VeRL's package is left alone."""
    try:
        import verl.tools
    except ImportError:
        return
    if isinstance(getattr(verl.tools, "__loader__", None), _Loader) and directory not in verl.tools.__path__:
        verl.tools.__path__.append(directory)
