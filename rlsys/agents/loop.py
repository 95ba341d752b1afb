"""Agent loops: one coroutine turns one prompt into one trajectory.

A loop is chosen by name (`rollout.agent_loop`, `eval.agent_loop`) like a reward: a
registered name (`single_turn`, `tool`) or `path/to/file.py:ClassName`. It subclasses
`AgentLoop` and implements `async run(request, sampling) -> Trajectory`; it samples with
`await self.generate(...)`, token ids in and token ids out, never re-tokenizing what was
sampled. A rollout engine runs every loop of a step concurrently in its event loop, so
one loop's tool call does not hold up another's generation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlsys.agents.trajectory import RolloutRequest, Sampling, Trajectory
from rlsys.config.loader import ConfigError
from rlsys.registry import Registry
from rlsys.user_code import load_entry

AGENT_LOOPS: Registry[type] = Registry("agent loop")


def register_agent_loop(name: str):
    def add(cls: type) -> type:
        AGENT_LOOPS.register(name, cls)
        return cls

    return add


@dataclass
class AgentContext:
    """What a loop works with, inside a rollout engine's actor."""

    engine: Any
    """`rlsys.rollout.request_engine.RequestEngine`: `await engine.generate(prompt_ids, params, images)`."""
    tokenizer: Any
    tools: Any = None
    """`rlsys.actors.tool_pool.ToolClient` when tools are configured, else None."""
    tool_schemas: list[dict] = field(default_factory=list)
    limits: Any = None
    """The job's `ToolsConfig`: turns, calls, tool-response tokens, time per call, parser."""


class AgentLoop:
    def __init__(self, context: AgentContext):
        self.context = context
        self.tokenizer = context.tokenizer

    async def run(self, request: RolloutRequest, sampling: Sampling) -> Trajectory:
        raise NotImplementedError

    async def generate(self, prompt_ids: list[int], sampling: Sampling, seed: int, max_tokens: int,
                       images: list | None = None):
        """One model turn continuing `prompt_ids`: a `Completion` (token ids, log-probs, finish reason).
        `images`: the pictures of the prompt's image tokens (`RolloutRequest.images`)."""
        return await self.context.engine.generate(prompt_ids, sampling_params(sampling, seed, max_tokens), images)


def sampling_params(sampling: Sampling, seed: int, max_tokens: int):
    """vLLM's parameters for one model turn: one sample, the sampled token's log-prob, flat (a few lists
    per response rather than a dict per token); vLLM detokenizes only to find stop strings (the
    responses are decoded in one batch afterwards)."""
    from vllm import SamplingParams

    return SamplingParams(n=1, temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=max_tokens,
                          stop=list(sampling.stop) or None, detokenize=bool(sampling.stop), logprobs=0,
                          flat_logprobs=True, seed=seed)


@register_agent_loop("single_turn")
class SingleTurnLoop(AgentLoop):
    """One model turn: the prompt's response, every token sampled."""

    async def run(self, request: RolloutRequest, sampling: Sampling) -> Trajectory:
        completion = await self.generate(request.prompt_ids, sampling, request.seed,
                                         min(sampling.max_new_tokens, sampling.max_response_tokens), request.images)
        ids = completion.token_ids
        return Trajectory(request.prompt_index, request.prompt_ids, ids, [1] * len(ids), completion.logprobs,
                          completion.versions, text=None, finish_reason=completion.finish_reason,
                          routing=completion.routing)


def resolve_agent_loop(spec: str, key: str) -> type:
    """The loop class of a registered name or `path/to/file.py:ClassName`; a ConfigError names `key`."""
    if spec in AGENT_LOOPS:
        return AGENT_LOOPS[spec]
    if ":" not in spec:
        raise ConfigError(f"{key}: unknown agent loop {spec!r}; registered: {', '.join(AGENT_LOOPS.names())} "
                          "(or give path/to/file.py:ClassName)")
    cls, name, path = load_entry(spec, key)
    if not (isinstance(cls, type) and issubclass(cls, AgentLoop)):
        raise ConfigError(f"{key}: {path} has no AgentLoop subclass {name!r}")
    return cls
