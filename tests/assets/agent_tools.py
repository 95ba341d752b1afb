"""Tools for the agent tests: one that raises, one that sleeps past its time limit, one slow to build."""

import time


def broken(expression: str) -> str:
    """Always fails."""
    raise ValueError(f"cannot evaluate {expression}")


def slow(seconds: float) -> str:
    """Sleeps."""
    time.sleep(seconds)
    return "done"


class SlowToStart:
    """A tool whose build takes 6 s (one that loads what it needs), then answers each call at once."""

    def __init__(self, config: dict, tool_schema):
        from rlsys.tools.base import BaseTool, ToolResponse

        time.sleep(6)
        self.tool = BaseTool(config, tool_schema)
        self.response = ToolResponse(text="ready")

    async def create(self, **kwargs):
        return await self.tool.create(**kwargs)

    async def execute(self, instance_id: str, parameters: dict, **kwargs):
        return self.response, 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        pass
