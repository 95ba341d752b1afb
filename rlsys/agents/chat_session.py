"""One agent harness's conversation with the policy, recorded token-exact for training.

A harness written against the OpenAI client sends its whole conversation at every call. The
session turns each call into token ids without re-tokenizing anything the engine sampled:

- the first call's messages go through the chat template (with the request's `tools`);
- a later chat call whose messages are the previous call's messages, then the reply the
  endpoint gave, then new messages (tool results, a user turn) continues the recorded tokens:
  the template's end of the sampled turn and its tokens for the new messages (`ChatTurns`),
  masked out of the loss;
- any other call (`/v1/completions` too) continues the recording when its prompt, rendered,
  starts with the recorded tokens.

A call that does neither (the harness edited or dropped earlier messages, or a template that
re-renders earlier turns differently) is a prefix break: it starts a new segment, and the
breaks are counted (`agent/prefix_breaks`). Every segment is trained on (`Trajectory.earlier`),
with the advantage of the episode, whose last segment ends in the harness's answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from rlsys.agents.chat import ChatTurns, TemplateError
from rlsys.data.examples import chat_ids


@dataclass
class Segment:
    """Calls that continue one another: the first call's prompt, then every token after it."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    """1 on a sampled token, 0 on the tokens between sampled turns."""
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    calls: int = 0
    tool_calls: int = 0
    last_turn: list[int] = field(default_factory=list)
    finish_reason: str = "stop"

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.ids


@dataclass
class Call:
    """One call's prompt: the tokens the engine continues, and which of them are new to the segment."""

    segment: Segment
    between: list[int]
    """Tokens after the segment's recording and before this call's sampled turn (masked out)."""

    @property
    def prompt_ids(self) -> list[int]:
        return self.segment.tokens + self.between


class ChatSession:
    def __init__(self, turns: ChatTurns, max_response_tokens: int):
        self.turns = turns
        self.tokenizer = turns.tokenizer
        self.max_response_tokens = max_response_tokens
        self.segments: list[Segment] = []
        self.prefix_breaks = 0
        self._conversation: list[tuple] | None = None
        """The last chat call's messages and the reply given, normalised: what the next call extends."""

    def chat_call(self, messages: list[dict], tools: list[dict] | None) -> Call:
        """The prompt of a chat call (`messages` as the OpenAI API takes them)."""
        segment = self.segments[-1] if self.segments else None
        conversation = [_normal(m) for m in messages]
        past = self._conversation
        if segment is not None and past is not None and conversation[:len(past)] == past:
            try:
                between = self.turns.next_turn(messages[len(past):])
            except TemplateError:  # a template that does not append turns: rendered whole below
                pass
            else:
                return Call(segment, self.turns.after_turn(segment.last_turn) + between)
        return self.prompt_call(chat_ids(messages, self.tokenizer, True, tools or None))

    def prompt_call(self, prompt_ids: list[int]) -> Call:
        """The prompt of a call given as tokens: a continuation when it extends the recording."""
        segment = self.segments[-1] if self.segments else None
        if segment is not None:
            recorded = segment.tokens
            if prompt_ids[:len(recorded)] == recorded:
                return Call(segment, prompt_ids[len(recorded):])
            self.prefix_breaks += 1
        self.segments.append(Segment(list(prompt_ids)))
        self._conversation = None
        return Call(self.segments[-1], [])

    def budget(self, call: Call) -> int:
        """Tokens the call may sample: what is left of the response budget after its prompt."""
        return self.max_response_tokens - len(call.segment.ids) - len(call.between)

    def record(self, call: Call, completion, tool_calls: int = 0) -> None:
        """The call's sampled turn (a `Completion`), after the tokens between."""
        segment = call.segment
        segment.ids += call.between + completion.token_ids
        segment.mask += [0] * len(call.between) + [1] * len(completion.token_ids)
        segment.logprobs += completion.logprobs
        segment.versions += completion.versions
        segment.calls += 1
        segment.tool_calls += tool_calls
        segment.last_turn = list(completion.token_ids)
        segment.finish_reason = completion.finish_reason

    def replied(self, messages: list[dict], reply: dict) -> None:
        """The chat call answered with `reply`: the conversation the next call should extend."""
        self._conversation = [_normal(m) for m in [*messages, reply]]


def _normal(message: dict) -> tuple:
    """What of a message the template renders: its role, its text and its tool calls (name and
    arguments, parsed), so that the SDK's own rendition of a reply (`refusal: None`, new call
    ids, re-serialised arguments) matches the reply given."""
    content = message.get("content") or ""
    if isinstance(content, list):  # content parts
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    calls = tuple((call.get("function", {}).get("name"), _arguments(call.get("function", {}).get("arguments")))
                  for call in message.get("tool_calls") or [])
    return message.get("role"), content, calls


def _arguments(arguments) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return json.dumps(arguments, sort_keys=True)
