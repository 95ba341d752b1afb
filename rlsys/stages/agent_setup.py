"""What a stage's rollout engines run: its agent loops by name and its tools, resolved and
checked before Ray starts, then the tool workers they call."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from rlsys.actors.tool_pool import ToolPool
from rlsys.agents.chat import ChatTurns, TemplateError
from rlsys.agents.context_hooks import ContextHook
from rlsys.agents.loop import resolve_agent_loop
from rlsys.agents.openai_loop import OpenAILoop
from rlsys.agents.tool_loop import ToolLoop
from rlsys.agents.tool_parsers import TOOL_PARSERS
from rlsys.config.loader import ConfigError
from rlsys.config.rollout import ToolsConfig
from rlsys.tools.registry import ToolSpec, load_tools
from rlsys.user_code import load_entry, split_entry


@dataclass
class AgentSetup:
    loops: dict[str, type] = field(default_factory=dict)
    """Each agent loop the stage runs, by its name in the config."""
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    specs: list[ToolSpec] = field(default_factory=list)

    @property
    def schemas(self) -> list[dict]:
        """The tools' OpenAI schemas, rendered into chat prompts through the template's `tools=`."""
        return [spec.schema for spec in self.specs]

    def check_template(self, tokenizer) -> None:
        """A loop that takes turns needs a chat template that appends a tool turn (`ChatTurns`)."""
        for name, cls in self.loops.items():
            if issubclass(cls, ToolLoop):
                try:
                    ChatTurns(tokenizer).next_turn([{"role": "tool", "content": "1"}])
                except TemplateError as err:
                    raise ConfigError(f"model.path: the {name} loop cannot use this model's chat template: {err}") \
                        from None

    def start_tools(self) -> ToolPool | None:
        """The tool workers, when there are tools."""
        return ToolPool(self.specs, self.tools.num_workers, self.tools.timeout_s) if self.specs else None


def agent_setup(loops: dict[str, str], tools: ToolsConfig, harness: Harness | None = None,
                context_hook: ContextHook | None = None) -> AgentSetup:
    """`loops`: config key -> loop name (`rollout.agent_loop`, `eval.agent_loop`); `harness`: what the
    openai loop runs; `context_hook`: what the tool loop runs before each turn (`resolve_context_hook`).
    A ConfigError names the key of what does not resolve."""
    import rlsys.tools  # noqa: F401  (registers the built-in tools)

    specs = load_tools(tools.names, tools.config_file, configs={"python": tools.sandbox})
    if tools.parser not in TOOL_PARSERS:
        raise ConfigError(f"tools.parser: unknown parser {tools.parser!r}; registered: "
                          f"{', '.join(TOOL_PARSERS.names())}")
    classes = {}
    for key, name in loops.items():
        classes[name] = resolve_agent_loop(name, key)
        if issubclass(classes[name], ToolLoop) and not specs:
            raise ConfigError(f"{key}: the {name} loop calls tools; give tools.names or tools.config_file")
        if issubclass(classes[name], OpenAILoop):
            classes[name] = classes[name].bind(*_harness(harness, key, name))
        if issubclass(classes[name], ToolLoop) and context_hook is not None:
            classes[name] = classes[name].bind(context_hook)
    return AgentSetup(classes, tools, specs)


@dataclass(frozen=True)
class Harness:
    """The openai loop's agent harness: `entry` (path/to/file.py:function) and its time per run."""

    entry: str
    timeout_s: float
    key: str
    """The config key of `entry`."""


def _harness(harness: Harness | None, key: str, name: str) -> tuple:
    """The harness function and its time limit; a ConfigError unless it is an async function."""
    if harness is None or not harness.entry:
        where = harness.key if harness else "rollout.agent_entry"
        raise ConfigError(f"{key}: the {name} loop runs an agent harness; give {where}: path/to/file.py:function")
    path, function = split_entry(harness.entry)
    if not path or not function:
        raise ConfigError(f"{harness.key}: {harness.entry!r} is not path/to/file.py:function")
    run, function, path = load_entry(harness.entry, harness.key)
    if not inspect.iscoroutinefunction(run):
        raise ConfigError(f"{harness.key}: {path} has no async function {function!r} "
                          "(async def run(client, row) -> str | dict)")
    return run, harness.timeout_s
