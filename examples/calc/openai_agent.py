"""The calculator task's agent written against the OpenAI client (`rollout.agent_loop: openai`):
the model may call the calculator once, the agent runs it and sends the result back, and the
model's next answer is the response. The same tool and turn limit as the `tool` loop's run."""

import json

from rlsys.tools.builtin import calculator

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


async def run(client, row: dict) -> str:
    messages = row["prompt"]
    for _ in range(2):  # model turns, as tools.max_turns in rlvr_tools.yaml
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculator(**json.loads(call.function.arguments))})
    return message.content or ""
