"""Context hooks: what the `tool` loop sends the model before each turn, when the history is rewritten.

A hook is `hook(messages: list[dict], tokenizer) -> list[dict]` (`rollout.context_hook`:
path/to/file.py:function, or a built-in name). Before each model turn after the first, the
loop hands it the conversation as OpenAI messages: the prompt's messages, each assistant
turn as the model wrote it (its tool-call markup included) and each tool result. A hook
that returns the list it was given (equal, not necessarily the same object) changes
nothing: the trajectory goes on from its own token ids. Any other list is the new history:
the chat template renders it into the next segment's prompt, and the segment before it is
kept for training with the episode's advantage (`Trajectory.earlier`).

Built in: `drop_tool_outputs`, which replaces the oldest tool outputs with a note until the
conversation fits `rollout.context_budget` tokens (the newest output is always kept).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from rlsys.config.loader import ConfigError
from rlsys.data.examples import chat_ids
from rlsys.user_code import load_entry, split_entry

ContextHook = Callable[[list[dict], object], list[dict]]
DROPPED_OUTPUT = "[output dropped to save context]"


def drop_tool_outputs(messages: list[dict], tokenizer, budget: int) -> list[dict]:
    """`messages` with their oldest tool outputs replaced by `DROPPED_OUTPUT`, one at a time, until
    the conversation renders to at most `budget` tokens (or only the newest output is left)."""
    messages = [dict(message) for message in messages]
    older_outputs = [i for i, m in enumerate(messages) if m.get("role") == "tool"][:-1]
    for i in older_outputs:
        if len(chat_ids(messages, tokenizer, add_generation_prompt=True)) <= budget:
            break
        messages[i]["content"] = DROPPED_OUTPUT
    return messages


BUILT_IN = {"drop_tool_outputs": drop_tool_outputs}


def resolve_context_hook(spec: str, budget: int, key: str = "rollout.context_hook") -> ContextHook | None:
    """The hook `spec` names (None for ""), a built-in one bound to `budget`; a ConfigError names `key`."""
    if not spec:
        return None
    if spec in BUILT_IN:
        return functools.partial(BUILT_IN[spec], budget=budget)
    path, name = split_entry(spec)
    if not path or not name:
        raise ConfigError(f"{key}: {spec!r} is neither a built-in hook ({', '.join(BUILT_IN)}) nor "
                          "path/to/file.py:function")
    hook, name, path = load_entry(spec, key)
    if not callable(hook) or inspect.iscoroutinefunction(hook):
        raise ConfigError(f"{key}: {path} has no function {name!r} (def hook(messages, tokenizer) -> messages)")
    return hook
