"""A context hook that compacts the calculator agent's history (`rollout.context_hook`): once a
tool result is in, the question is dropped and the call and its result kept, as a harness that
keeps only what the next step needs. The answer is then sampled from the rewritten history: a
second segment of the episode, whose first segment holds the decision to call.

Dropping the call instead and keeping the question takes the fine-tuned model's greedy copying of
the result from 83% to 0% (a tool turn straight after the question is a context it never saw);
dropping the question takes it to 46% (100 held-out problems, the true product as the result)."""


def drop_question(messages: list[dict], tokenizer) -> list[dict]:
    if not any(m["role"] == "tool" for m in messages):
        return messages
    return [m for m in messages if m["role"] != "user"]
