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

With `rollout.context_hook` (`rlsys.agents.context_hooks`), the loop also keeps the
conversation as messages and hands it to the hook before each model turn after the first;
a history the hook rewrites becomes the prompt of a new segment of the episode, and the
response budget counts each segment's own tokens.
"""

from __future__ import annotations

import logging
import uuid

from rlsys.agents.chat import ChatTurns
from rlsys.agents.loop import AgentContext, AgentLoop, register_agent_loop
from rlsys.agents.tool_parsers import TOOL_PARSERS, ToolCall
from rlsys.agents.trajectory import RolloutRequest, Sampling, Trajectory
from rlsys.data.examples import chat_ids
from rlsys.seeds import turn_seed
from rlsys.tools.base import ToolResult

log = logging.getLogger(__name__)


@register_agent_loop("tool")
class ToolLoop(AgentLoop):
    context_hook = None
    """`hook(messages, tokenizer) -> messages`, run before each model turn after the first: set by `bind`."""

    @classmethod
    def bind(cls, context_hook) -> type:
        """This loop with `context_hook`."""
        return type(cls.__name__, (cls,), {"context_hook": staticmethod(context_hook)})

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
            if state.turns and self.context_hook is not None:
                self._rewrite_history(state)
            budget = min(sampling.max_response_tokens - len(state.mask),
                         self.context.engine.max_model_len - len(state.ids))
            if budget <= 0:
                state.finish = "length"
                return
            completion = await self.generate(state.ids, sampling, turn_seed(state.request.seed, state.turns),
                                             min(sampling.max_new_tokens, budget), state.request.images)
            state.add_turn(completion)
            state.add_message({"role": "assistant", "content": self.tokenizer.decode(completion.token_ids,
                                                                                     skip_special_tokens=True)})
            if completion.finish_reason != "stop" or state.turns >= self.limits.max_turns:
                return
            calls = self.parser.parse(self.tokenizer.decode(completion.token_ids))
            if not calls:
                return
            results = [await self._call(state, call) for call in calls]
            tool_messages = [{"role": "tool", "content": result.text} for result in results]
            observation = self.turns.after_turn(completion.token_ids) + self.turns.next_turn(tool_messages)
            if len(state.mask) + len(observation) >= sampling.max_response_tokens:
                state.finish = "length"
                return
            state.add_observation(observation)
            for message in tool_messages:
                state.add_message(message)

    def _rewrite_history(self, state: _State) -> None:
        """The hook's history for the next turn: a rewritten one starts a new segment. A hook that
        raises or returns something else than messages leaves the history as it is (logged)."""
        try:
            messages = self.context_hook([dict(m) for m in state.messages], self.tokenizer)
            if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
                raise TypeError(f"returned {type(messages).__name__}, not a non-empty list of messages")
        except Exception as err:  # the user's hook: the trajectory goes on with its history
            log.warning("rollout.context_hook failed on prompt %d: %s: %s", state.request.prompt_index,
                        type(err).__name__, err)
            return
        if messages != state.messages:
            schemas = self.context.tool_schemas or None
            state.new_segment(chat_ids(messages, self.tokenizer, add_generation_prompt=True, tools=schemas), messages)

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
    """One episode as it grows: its earlier segments, and the current one's tokens."""

    def __init__(self, request: RolloutRequest, key: str):
        self.request, self.key = request, key
        self.prompt_ids = request.prompt_ids
        self.ids = list(request.prompt_ids)
        self.earlier: list[Trajectory] = []
        self.messages = _prompt_messages(request.row)
        """The conversation as messages (kept for a context hook)."""
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

    def add_message(self, message: dict) -> None:
        self.messages.append(message)

    def new_segment(self, prompt_ids: list[int], messages: list[dict]) -> None:
        """End the current segment at its last sampled token (the tool turn after it is the next
        segment's to render); the next starts from `prompt_ids`, the rendering of `messages`."""
        sampled = len(self.mask) - self.mask[::-1].index(1) if 1 in self.mask else 0
        self.earlier.append(Trajectory(self.request.prompt_index, self.prompt_ids,
                                       self.ids[len(self.prompt_ids):len(self.prompt_ids) + sampled],
                                       self.mask[:sampled], self.logprobs, self.versions, text="",
                                       finish_reason="rewritten"))
        self.prompt_ids, self.ids, self.messages = prompt_ids, list(prompt_ids), messages
        self.mask, self.logprobs, self.versions = [], [], []

    def trajectory(self, final_turn: str) -> Trajectory:
        return Trajectory(self.request.prompt_index, self.prompt_ids, self.ids[len(self.prompt_ids):], self.mask,
                          self.logprobs, self.versions, text=None, finish_reason=self.finish, num_turns=self.turns,
                          tool_calls=self.tool_calls, tool_errors=self.tool_errors, tool_seconds=self.tool_seconds,
                          reward_info={"num_turns": self.turns, "tool_calls": self.tool_calls,
                                       "tool_rewards": self.tool_rewards, "final_turn": final_turn},
                          routing=self.routing, earlier=self.earlier)


def _prompt_messages(row: dict) -> list[dict]:
    """The data row's prompt as chat messages (a plain-text prompt as one user message)."""
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(message) for message in prompt or []]
