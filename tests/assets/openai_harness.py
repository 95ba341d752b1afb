"""An agent harness for the openai loop's RL test: one chat call, answered as the model wrote it.
It fails, as a harness's own bug would, on every prompt whose characters sum to a multiple of 4;
on those whose sum leaves 1 it first drafts an answer, then asks again with the question alone
restated (a rewritten history: the episode's second segment)."""


async def run(client, row: dict) -> str:
    question = row["prompt"][-1]["content"]
    if sum(map(ord, question)) % 4 == 0:
        raise ValueError(f"cannot handle {question!r}")
    if sum(map(ord, question)) % 4 == 1:
        await client.chat.completions.create(model="policy", messages=row["prompt"], max_tokens=4)
        restated = [{"role": "user", "content": question + " "}]
        reply = await client.chat.completions.create(model="policy", messages=restated)
        return reply.choices[0].message.content or ""
    reply = await client.chat.completions.create(model="policy", messages=row["prompt"])
    return reply.choices[0].message.content or ""


def not_async(client, row: dict) -> str:
    return ""
