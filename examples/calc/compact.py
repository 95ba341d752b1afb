"""A context hook that compacts the calculator agent's history (`rollout.context_hook`): once a
tool result is in, the assistant's tool-call turns are dropped and the results kept, as a harness
that keeps observations and forgets its own calls would. The answer is then sampled from the
rewritten history: a second segment of the episode, whose first segment holds the call."""


def drop_calls(messages: list[dict], tokenizer) -> list[dict]:
    return [m for m in messages if not (m["role"] == "assistant" and "<tool_call>" in m["content"])]
