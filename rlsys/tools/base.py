"""The tool interface: VeRL's `BaseTool` and its OpenAI function schemas, so a tool written for
VeRL runs as it is (`verl_compat` serves its VeRL imports where VeRL is not installed).

A tool has a name and an OpenAI function schema (rendered into the prompt through the chat
template's `tools=`), and four async methods: `create` an instance for a trajectory (with the
data row's `tools_kwargs[name]["create_kwargs"]`), `execute` a call on it, `calc_reward` of its
state, `release` it. The agent loop creates a tool's instance on the trajectory's first call to
it and releases it when the trajectory ends; VeRL's current loop instead creates and releases one
for each call, which a tool written for it also runs under. `execute` gets `agent_data=` where its
signature takes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal
from uuid import uuid4

from pydantic import BaseModel, Field


class OpenAIFunctionPropertySchema(BaseModel):
    type: str
    description: str | None = None
    enum: list[str] | None = None


class OpenAIFunctionParametersSchema(BaseModel):
    type: str
    properties: dict[str, OpenAIFunctionPropertySchema]
    required: list[str]


class OpenAIFunctionSchema(BaseModel):
    name: str
    description: str
    parameters: OpenAIFunctionParametersSchema = Field(
        default_factory=lambda: OpenAIFunctionParametersSchema(type="object", properties={}, required=[]))
    strict: bool = False


class OpenAIFunctionToolSchema(BaseModel):
    type: str
    function: OpenAIFunctionSchema


class OpenAIFunctionParsedSchema(BaseModel):
    """A call as parsed from the model's text: its arguments still a JSON string."""

    name: str
    arguments: str


class OpenAIFunctionCallSchema(BaseModel):
    name: str
    arguments: dict[str, Any]


class OpenAIFunctionToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: OpenAIFunctionCallSchema


class ToolResponse(BaseModel):
    """What a call returns to the model: text (images and video are not rendered by rlsys)."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None


@dataclass
class AgentData:
    """What VeRL's agent loop passes a tool's `execute` as `agent_data=`: the trajectory it serves."""

    request_id: str
    """The trajectory's key: every call of one trajectory carries the same."""
    tools_kwargs: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    extra_fields: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ToolResult:
    """One call as the model sees it: the text of its tool turn, and whether it failed."""

    text: str
    error: bool = False
    """The call was malformed, named no tool, raised or ran out of time (the text says which)."""
    seconds: float = 0.0
    reward: float = 0.0
    """The step reward `execute` returned."""


class BaseTool:
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None):
        self.config = config
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ValueError(f"{type(self).__name__}: no tool schema given and none of its own")
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | None:
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        return instance_id or str(uuid4()), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs
                      ) -> tuple[ToolResponse, float, dict]:
        """Returns the response, a step reward and metrics."""
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        pass


def schema_dict(tool: BaseTool) -> dict:
    """The tool's schema as the chat template's `tools=` takes it."""
    return tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True)


def response_text(response: ToolResponse | dict | str) -> str:
    """A tool's response as text (older VeRL tools return a dict or a string)."""
    if isinstance(response, ToolResponse):
        return response.text or ""
    if isinstance(response, dict):
        return str(response.get("text", "")) if "text" in response else json.dumps(response)
    return str(response)
