"""Built-in tools: `calculator` (arithmetic, evaluated without `eval`) and `python` (code run in
the sandbox, `rlsys.sandbox`)."""

from __future__ import annotations

import ast
import asyncio
import operator
from typing import Any

from rlsys.sandbox.local import limits_from, require_isolation, run_python
from rlsys.tools.base import BaseTool, OpenAIFunctionToolSchema, ToolResponse
from rlsys.tools.registry import register_tool

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}
_MAX_EXPONENT = 64
_MAX_DIGITS = 64


@register_tool("calculator")
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers, + - * / // % ** and parentheses."""
    try:
        value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError, ZeroDivisionError, OverflowError) as err:
        return f"error: {type(err).__name__}: {err}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} is over {_MAX_EXPONENT}")
        value = _OPERATORS[type(node.op)](left, right)
        if isinstance(value, int) and len(str(abs(value))) > _MAX_DIGITS:
            raise ValueError(f"a result of more than {_MAX_DIGITS} digits")
        return value
    raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")


@register_tool("python")
class PythonTool(BaseTool):
    """Runs the model's code in the sandbox and answers with its output: stdout, then stderr when
    it failed. `config`: SandboxLimits' fields (wall_s, cpu_s, memory_mb, disk_mb, ..., allow_weaker);
    built where a layer of the sandbox is missing and weaker isolation is not accepted, it refuses."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None = None):
        settings = {key: value for key, value in (config or {}).items() if key != "type"}  # VeRL's `type: native`
        self.limits = limits_from(settings)
        require_isolation(self.limits)
        super().__init__(config or {}, tool_schema or OpenAIFunctionToolSchema.model_validate({
            "type": "function",
            "function": {"name": "python", "description": "Run a Python program and read what it prints.",
                         "parameters": {"type": "object", "required": ["code"],
                                        "properties": {"code": {"type": "string",
                                                                "description": "The program."}}}}}))

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        result = await asyncio.to_thread(run_python, str(parameters.get("code", "")), "", self.limits)
        text = result.stdout if result.ok else f"{result.stdout}{result.stderr}\n[{result.status}]".lstrip()
        return ToolResponse(text=text), 0.0, {"sandbox_s": result.wall_s}
