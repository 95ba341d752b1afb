"""Tools an agent loop calls: VeRL's BaseTool interface, a registry, built-in tools."""

from rlsys.tools import builtin  # noqa: F401  (registers the built-in tools)
from rlsys.tools.base import BaseTool, OpenAIFunctionToolSchema, ToolResponse
from rlsys.tools.registry import register_tool

__all__ = ["BaseTool", "OpenAIFunctionToolSchema", "ToolResponse", "register_tool"]
