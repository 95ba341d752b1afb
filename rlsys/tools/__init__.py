"""Tools an agent loop calls: VeRL's BaseTool interface, a registry, built-in tools."""

from rlsys.tools import builtin, verl_compat  # noqa: F401  (registers the built-in tools)
from rlsys.tools.base import BaseTool, OpenAIFunctionToolSchema, ToolResponse
from rlsys.tools.registry import register_tool

verl_compat.install()  # a VeRL tool file's imports, where VeRL is not installed (here and in every tool worker)

__all__ = ["BaseTool", "OpenAIFunctionToolSchema", "ToolResponse", "register_tool"]
