"""The `tool` agent loop: the model calls tools, reads their answers, and goes on.

Each model turn continues the trajectory's own token ids. A turn that ends with tool calls
(`tools.parser`) gets one tool turn back: each call's result, or an error observation for a
call that is malformed, names an unknown tool, raises or runs out of time (counted in
`tool_errors`; the trajectory goes on). The tool turn is the chat template's tokens for the
results (`ChatTurns`), each result cut to `tools.max_response_tokens` tokens, and is masked
out of the loss. The trajectory ends at a turn without calls, after `tools.max_turns` model
turns, or when the next turn would not fit `rollout.max_response_tokens`. Calls run in the
tool workers (`rlsys.actors.tool_pool`); each tool's instance lives for the trajectory, and
its `calc_reward` reaches the reward as `extra_info["tool_rewards"]`.
"""

from __future__ import annotations

import uuid

from rlsys.agents.chat import ChatTurns
from rlsys.agents.loop import TURN_SEED_STRIDE, AgentContext, AgentLoop, register_agent_loop
from rlsys.agents.tool_parsers import TOOL_PARSERS, ToolCall
from rlsys.agents.trajectory import RolloutRequest, Sampling, Trajectory
from rlsys.tools.base import ToolResult


@register_agent_loop("tool")
class ToolLoop(AgentLoop):
    def __init__(self, context: AgentContext):
        super().__init__(context)
        self.limits = context.limits
        self.turns = ChatTurns(context.tokenizer)
        self.parser = TOOL_PARSERS[self.limits.parser]()
        self.tool_names = {schema["function"]["name"] for schema in context.tool_schemas}

    async def run(self, request: RolloutRequest, sampling: Sampling) -> Trajectory:
        state = _State(request, key=f"{request.prompt_index}-{request.sample}-{uuid.uuid4().hex[:8]}")
        try:
            await self._turns(state, sampling)
        finally:
            state.tool_rewards = await self.context.tools.finish(state.key) if self.context.tools else []
        return state.trajectory(final_turn=self.tokenizer.decode(state.last_turn, skip_special_tokens=True))

    async def _turns(self, state: _State, sampling: Sampling) -> None:
        while True:
            budget = sampling.max_response_tokens - len(state.mask)
            if budget <= 0:
                state.finish = "length"
                return
            completion = await self.generate(state.ids, sampling, state.request.seed + state.turns * TURN_SEED_STRIDE,
                                             min(sampling.max_new_tokens, budget), state.request.images)
            state.add_turn(completion)
            if completion.finish_reason != "stop" or state.turns >= self.limits.max_turns:
                return
            calls = self.parser.parse(self.tokenizer.decode(completion.token_ids))
            if not calls:
                return
            results = [await self._call(state, call) for call in calls]
            observation = self.turns.after_turn(completion.token_ids) + self.turns.next_turn(
                [{"role": "tool", "content": result.text} for result in results])
            if len(state.mask) + len(observation) >= sampling.max_response_tokens:
                state.finish = "length"
                return
            state.add_observation(observation)

    async def _call(self, state: _State, call: ToolCall) -> ToolResult:
        state.tool_calls += 1
        if call.error:
            result = ToolResult(f"Error: {call.error}", error=True)
        elif call.name not in self.tool_names:
            result = ToolResult(f"Error: there is no tool {call.name!r}; tools: {', '.join(sorted(self.tool_names))}",
                                error=True)
        elif state.tool_calls > self.limits.max_calls:
            result = ToolResult(f"Error: no more tool calls ({self.limits.max_calls} per answer)", error=True)
        else:
            create_kwargs = state.request.tools_kwargs.get(call.name, {}).get("create_kwargs", {})
            result = await self.context.tools.call(state.key, call.name, call.arguments, create_kwargs)
        state.tool_errors += result.error
        state.tool_seconds += result.seconds
        return ToolResult(self._truncated(result.text), result.error, result.seconds, result.reward)

    def _truncated(self, text: str) -> str:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        limit = self.limits.max_response_tokens
        return text if len(ids) <= limit else self.tokenizer.decode(ids[:limit]) + "...(truncated)"


class _State:
    """One trajectory as it grows."""

    def __init__(self, request: RolloutRequest, key: str):
        self.request, self.key = request, key
        self.ids = list(request.prompt_ids)
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.turns = self.tool_calls = self.tool_errors = 0
        self.tool_seconds = 0.0
        self.finish = "stop"
        self.tool_rewards: list[float] = []
        self.last_turn: list[int] = []
        self.routing = None
        """The last model turn's routing: it covers every token before that turn's last (R3)."""

    def add_turn(self, completion) -> None:
        self.turns += 1
        self.ids += completion.token_ids
        self.mask += [1] * len(completion.token_ids)
        self.logprobs += completion.logprobs
        self.versions += completion.versions
        self.finish = completion.finish_reason
        self.last_turn = completion.token_ids
        self.routing = completion.routing

    def add_observation(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)

    def trajectory(self, final_turn: str) -> Trajectory:
        prompt = len(self.request.prompt_ids)
        return Trajectory(self.request.prompt_index, self.request.prompt_ids, self.ids[prompt:], self.mask,
                          self.logprobs, self.versions, text=None, finish_reason=self.finish, num_turns=self.turns,
                          tool_calls=self.tool_calls, tool_errors=self.tool_errors, tool_seconds=self.tool_seconds,
                          reward_info={"num_turns": self.turns, "tool_calls": self.tool_calls,
                                       "tool_rewards": self.tool_rewards, "final_turn": final_turn},
                          routing=self.routing)
