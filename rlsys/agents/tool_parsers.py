"""Tool calls in a sampled turn's text, by format (`tools.parser`).

`hermes` (Hermes, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
any number in a turn. A call that cannot be read (not JSON, no name, arguments not an object)
is kept as a call with an error, so the loop answers it with an error observation instead of
dropping it. A parser is a class with `parse(text) -> list[ToolCall]` and `strip_calls(text) -> str`
(the text without its calls, for the OpenAI endpoint's replies), registered by name.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from rlsys.registry import Registry

TOOL_PARSERS: Registry[type] = Registry("tool-call parser")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    """Why the call as written cannot be made ("" when it can)."""


def register_tool_parser(name: str):
    def add(cls: type) -> type:
        TOOL_PARSERS.register(name, cls)
        return cls

    return add


@register_tool_parser("hermes")
class HermesParser:
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        return [_read_call(body) for body in self._CALL.findall(text)]

    def strip_calls(self, text: str) -> str:
        """The text around the calls (an OpenAI reply's `content` beside its `tool_calls`)."""
        return self._CALL.sub("", text).strip()


def _read_call(body: str) -> ToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as err:
        return ToolCall("", error=f"the tool call is not valid JSON ({err.msg} at character {err.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall("", error='the tool call needs a "name" string')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models send the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], error='the tool call\'s "arguments" must be an object')
    return ToolCall(call["name"], arguments)
