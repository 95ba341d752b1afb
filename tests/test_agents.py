"""Multi-turn agent loops with tools, token in and token out; agent harnesses written against the
OpenAI client, through the rollout engine's OpenAI-compatible endpoint.

A tiny model fine-tuned to call the calculator and answer with its result runs the `tool`
loop in a rollout engine, its calls served by the tool workers: each trajectory's tokens are the
prompt, the sampled turns and the template's tool turns exactly, with exact masks, and the
engine's log-probs of the sampled tokens equal the model's own across turns. Malformed calls,
unknown tools, tools that raise or run out of time become error observations and counts. A
tool written for VeRL runs from VeRL's tool YAML.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch
from conftest import QUESTION

from rlsys.agents.chat import ChatTurns
from rlsys.agents.openai_loop import OpenAILoop
from rlsys.agents.tool_loop import ToolLoop, _State
from rlsys.agents.tool_parsers import HermesParser
from rlsys.agents.trajectory import RolloutRequest, Sampling, Trajectories, Trajectory
from rlsys.config.rollout import RolloutConfig, ToolsConfig
from rlsys.tools.builtin import calculator
from rlsys.tools.registry import load_tools
from rlsys.user_code import import_user_code

# One xdist worker runs this module and test_async_rl (scripts/test.sh): the tool-calling model they
# both use, and its engine here, built once.
pytestmark = pytest.mark.xdist_group("tool_caller")

ASSETS = os.path.join(os.path.dirname(__file__), "assets")


@pytest.fixture(scope="module")
def tool_pool(ray_cluster, calculator_tools):
    from rlsys.actors.tool_pool import ToolPool

    specs = calculator_tools + load_tools([f"{ASSETS}/agent_tools.py:broken", f"{ASSETS}/agent_tools.py:slow"], "")
    pool = ToolPool(specs, num_workers=2, timeout_s=10.0)  # far above a loaded machine's calculator call
    yield pool
    pool.shutdown()


@pytest.fixture(scope="module")
def engine(tool_caller, tool_pool, calculator_tools):
    """A rollout engine in this process running the tool loop, its calls going to the tool workers,
    and the openai loop with the harnesses below."""
    from rlsys.actors.rollout_worker import RolloutWorker, RolloutWorkerSpec

    tools = ToolsConfig(names=["calculator"], max_turns=3, timeout_s=10.0)
    harnesses = {"openai": OpenAILoop.bind(calculator_agent, 60.0), "edits": OpenAILoop.bind(editing_agent, 60.0),
                 "completions": OpenAILoop.bind(completions_agent, 60.0),
                 "failing": OpenAILoop.bind(failing_agent, 20.0), "streaming": OpenAILoop.bind(streaming_agent, 60.0),
                 "text": OpenAILoop.bind(text_agent, 60.0)}
    return RolloutWorker(RolloutWorkerSpec(tool_caller, RolloutConfig(engine_memory_gib=0.1, block_size=32), seed=0,
                                           num_threads=2, loops={"tool": ToolLoop, **harnesses}, tools=tools,
                                           tool_client=tool_pool.client(),
                                           tool_schemas=[s.schema for s in calculator_tools]))


@pytest.mark.quick
def test_trajectories_travel_with_their_routing():
    """An engine's trajectories as columns and back: each keeps its own routing (R3), a trajectory
    without one gets None, and columns of trajectories without routing carry none."""
    import numpy as np

    requests = [RolloutRequest(0, [1, 2], j, seed=j) for j in range(3)]
    routings = [np.full((4, 2, 1), 7, np.uint8), None, np.full((3, 2, 1), 9, np.uint8)]
    trajectories = [Trajectory(0, [1, 2], [3, 4, 5][:j + 1], [1] * (j + 1), [0.0] * (j + 1), [0] * (j + 1), None,
                               "stop", routing=routing) for j, routing in enumerate(routings)]
    back = Trajectories.of(trajectories, requests).unpack({0: [1, 2]})
    assert back[1].routing is None
    assert back[0].routing.tolist() == routings[0].tolist() and back[2].routing.tolist() == routings[2].tolist()
    for t in trajectories:
        t.routing = None
    columns = Trajectories.of(trajectories, requests)
    assert columns.routing is None and all(t.routing is None for t in columns.unpack({0: [1, 2]}))


@pytest.mark.quick
def test_an_episodes_earlier_segments_travel_with_it():
    """Between actors as columns, and in an asynchronous run's checkpoint as JSON."""
    import json

    from rlsys.rl.rollout_stream import _restored, _saved

    first = Trajectory(0, [1, 2], [3, 4], [1, 1], [-0.5, -0.25], [0, 0], "", "rewritten", num_turns=1)
    episode = Trajectory(0, [5, 6], [7], [1], [-0.125], [1], "7", "stop", num_turns=2, earlier=[first])
    plain = Trajectory(0, [1, 2], [8], [1], [-0.375], [1], "8", "stop")
    requests = [RolloutRequest(0, [1, 2], j, seed=j) for j in range(2)]
    assert Trajectories.of([episode, plain], requests).unpack({0: [1, 2]}) == [episode, plain]
    assert _restored(json.loads(json.dumps(_saved(episode)))) == episode
    assert episode.segments() == [first, episode] and episode.segments("last") == [episode]


def test_a_trajectory_is_the_prompt_the_sampled_turns_and_the_tool_turns_exactly(engine, tool_caller,
                                                                                calculator_tools):
    assert_tool_trajectories(engine, tool_caller, calculator_tools, "tool")


def assert_tool_trajectories(engine, model_dir: str, calculator_tools, loop: str) -> None:
    """4 samples of the calculator question through `loop`: at least 3 call the calculator, and
    each of those is the prompt, the sampled call, the template's tool turn and the answer, with
    exact masks; the engine's log-prob of every sampled token is `model_dir`'s."""
    from transformers import AutoModelForCausalLM

    tokenizer = engine.tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                           tools=[s.schema for s in calculator_tools], tokenize=False,
                                           add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=100, max_response_tokens=200)
    columns = asyncio.run(engine.rollout([(0, prompt_ids, {})], loop, 4, sampling, seed=5))
    trajectories = columns.unpack({0: prompt_ids})

    turns = ChatTurns(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    multi_turn = [t for t in trajectories if t.num_turns > 1]
    assert len(multi_turn) >= 3, [t.text for t in trajectories]
    for trajectory in multi_turn:
        first_turn = _first_run(trajectory.response_mask, 1)
        call_ids = trajectory.response_ids[:first_turn]
        [call] = HermesParser().parse(tokenizer.decode(call_ids))
        expected_observation = turns.after_turn(call_ids) + turns.next_turn(
            [{"role": "tool", "content": calculator(**call.arguments)}])
        observation = trajectory.response_ids[first_turn:first_turn + len(expected_observation)]
        assert observation == expected_observation
        assert trajectory.response_mask == ([1] * first_turn + [0] * len(expected_observation)
                                            + [1] * (len(trajectory.response_ids) - first_turn
                                                     - len(expected_observation)))
        assert (trajectory.tool_calls, trajectory.tool_errors, trajectory.num_turns) == (1, 0, 2)
        assert trajectory.reward_info["final_turn"] == "408"
        assert_engine_logprobs(model, trajectory)


def assert_engine_logprobs(model, trajectory, temperature: float = 1.0) -> None:
    """The engine's log-prob of every sampled token, in every turn, is the model's (at the sampling
    temperature)."""
    from rlsys.algorithms.lm_loss import logprobs_of_labels

    prompt_ids = trajectory.prompt_ids
    ids = torch.tensor([prompt_ids + trajectory.response_ids])
    with torch.no_grad():
        reference = logprobs_of_labels(model(input_ids=ids).logits / temperature, ids)[0, len(prompt_ids) - 1:]
    sampled = torch.tensor(trajectory.response_mask).bool()
    assert len(trajectory.logprobs) == int(sampled.sum())
    assert (reference[sampled] - torch.tensor(trajectory.logprobs)).abs().max() < 1e-4


def test_bad_calls_become_error_observations_and_counts(engine, tool_caller):
    """Each error reaches the model as a tool turn and counts; the trajectory goes on."""
    loop = engine.loops["tool"]
    loop.tool_names |= {"broken", "slow"}
    calls = HermesParser().parse('<tool_call>{"name": "calculator", "arguments": {"expression": 1+}</tool_call>'
                                 '<tool_call>{"name": "shell", "arguments": {}}</tool_call>'
                                 '<tool_call>{"name": "broken", "arguments": {"expression": "1/0"}}</tool_call>'
                                 '<tool_call>{"name": "slow", "arguments": {"seconds": 30}}</tool_call>'
                                 '<tool_call>{"name": "calculator", "arguments": {"expression": "2**10"}}</tool_call>')
    state = _State(RolloutRequest(0, [1], 0, 0), key="errors")

    async def call_all():
        results = [await loop._call(state, call) for call in calls]
        await engine.loops["tool"].context.tools.finish(state.key)
        return results

    results = asyncio.run(call_all())
    assert [r.error for r in results] == [True, True, True, True, False]
    assert "not valid JSON" in results[0].text
    assert "there is no tool 'shell'" in results[1].text
    assert "ValueError: cannot evaluate 1/0" in results[2].text
    assert "did not finish within 10 s" in results[3].text
    assert results[4].text == "1024"
    assert (state.tool_calls, state.tool_errors) == (5, 4)


def test_a_tools_build_does_not_count_against_its_first_calls_limit(ray_cluster):
    """A tool whose build takes 6 s answers its first call within a 0.5 s limit: the pool is up
    before a call's clock starts (the caller waits for a worker's start only once, in `ToolPool`)."""
    from rlsys.actors.tool_pool import ToolPool
    from rlsys.tools.registry import ToolSpec

    module = import_user_code(f"{ASSETS}/agent_tools.py", "tools.names")
    schema = {"type": "function", "function": {"name": "ready", "description": "Answers at once.",
                                               "parameters": {"type": "object", "properties": {}, "required": []}}}
    pool = ToolPool([ToolSpec("ready", module.SlowToStart, {}, schema)], num_workers=1, timeout_s=0.5,
                    role="slow_tool")
    try:
        result = asyncio.run(pool.client().call("t", "ready", {}, {}))
    finally:
        pool.shutdown()
    assert not result.error and result.text == "ready", result


def test_a_verl_tool_runs_from_verls_tool_yaml(tool_pool, ray_cluster):
    """VeRL's Gsm8kTool and its tool YAML as VeRL ships them (tests/assets/verl_tools, VeRL not
    installed): the schema reaches the prompt, the instance is created with the row's
    create_kwargs, and calc_reward scores its state with VeRL's flexible GSM8K check."""
    from rlsys.actors.tool_pool import ToolPool

    [spec] = load_tools([], f"{ASSETS}/verl_tools/tool_config.yaml")
    assert spec.name == "calc_gsm8k_reward" and spec.schema["function"]["parameters"]["required"] == ["answer"]
    pool = ToolPool([spec], num_workers=1, timeout_s=5.0, role="verl_tool")
    client = pool.client()

    async def episode():
        first = await client.call("t", "calc_gsm8k_reward", {"answer": "41"}, {"ground_truth": "42"})
        second = await client.call("t", "calc_gsm8k_reward", {"answer": "42"}, {"ground_truth": "42"})
        return first, second, await client.finish("t")

    try:
        first, second, rewards = asyncio.run(episode())
    finally:
        pool.shutdown()
    assert "reward=0.0" in first.text and first.reward == pytest.approx(-0.05)
    assert "reward=1.0" in second.text and second.reward == 0.0
    assert rewards == [1.0]


@pytest.mark.quick
def test_verl_imports_resolve_to_rlsys_where_verl_is_not_installed():
    """A VeRL tool file's imports: BaseTool and schemas are rlsys's, the tracing decorator returns the
    function itself, VeRL's GSM8K check scores as VeRL's (strict and flexible); other VeRL modules
    are not pretended."""
    import importlib

    from rlsys.tools.base import BaseTool

    assert importlib.import_module("verl.tools.base_tool").BaseTool is BaseTool
    trace = importlib.import_module("verl.utils.rollout_trace").rollout_trace_op
    assert trace(calculator) is calculator
    gsm8k = importlib.import_module("verl.utils.reward_score.gsm8k")
    assert gsm8k.compute_score("so #### 1,234", "1234") == 1.0
    assert gsm8k.compute_score("so 1,234", "1234") == 0.0
    assert gsm8k.compute_score("it is 42.", "42", method="flexible") == 0.0  # VeRL keeps the dot: "42."
    assert gsm8k.compute_score("it is 42 .", "42", method="flexible") == 1.0
    assert gsm8k.compute_score("41", "42", method="flexible", format_score=0.1) == 0.1
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("verl.trainer.ppo")


def _first_run(mask: list[int], value: int) -> int:
    """Length of the mask's leading run of `value`."""
    return next((i for i, m in enumerate(mask) if m != value), len(mask))


# -- the openai loop: harnesses written against the OpenAI client ------------------------------

CALC_AGENT = import_user_code(os.path.join(os.path.dirname(__file__), "..", "examples", "calc", "openai_agent.py"),
                              "examples/calc/openai_agent.py")
TOOLS = CALC_AGENT.TOOLS
calculator_agent = CALC_AGENT.run
"""The calculator example's harness: up to two model turns, a calculator call answered by the
harness itself, then the answer."""


async def editing_agent(client, row: dict) -> str:
    """Asks once, then asks again with its question rewritten: the second call breaks the prefix."""
    await client.chat.completions.create(model="policy", messages=row["prompt"], max_tokens=4)
    edited = [{"role": "user", "content": QUESTION + " "}]
    reply = await client.chat.completions.create(model="policy", messages=edited, max_tokens=4)
    return reply.choices[0].message.content or ""


async def completions_agent(client, row: dict) -> dict:
    reply = await client.completions.create(model="policy", prompt=row["extra_info"]["text"], max_tokens=6)
    return {"response": reply.choices[0].text, "extra_info": {"finish": reply.choices[0].finish_reason}}


async def failing_agent(client, row: dict):
    mode = row["extra_info"]["mode"]
    if mode != "silent":
        await client.chat.completions.create(model="policy", messages=row["prompt"], max_tokens=2)
    if mode == "raise":
        raise RuntimeError("the harness broke")
    if mode == "hang":
        await asyncio.sleep(3600)
    return 5 if mode == "bad_return" else "the answer"


async def streaming_agent(client, row: dict) -> str:
    """The calculator harness with every call streamed: the reply put together from its chunks."""
    messages = row["prompt"]
    for _ in range(2):
        stream = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, stream=True)
        content, calls = "", {}
        async for chunk in stream:
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for call in choice.delta.tool_calls or []:
                    entry = calls.setdefault(call.index, {"id": "", "type": "function",
                                                          "function": {"name": "", "arguments": ""}})
                    entry["id"] += call.id or ""
                    entry["function"]["name"] += call.function.name or ""
                    entry["function"]["arguments"] += call.function.arguments or ""
        if not calls:
            break
        messages.append({"role": "assistant", "content": content or None, "tool_calls": list(calls.values())})
        for call in calls.values():
            arguments = json.loads(call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": calculator(**arguments)})
    return content


async def text_agent(client, row: dict) -> dict:
    """One call without tools, chat or completions (`extra_info.api`), streamed or not: the reply's
    text, with the number of chunks it came in and the usage reported."""
    api, stream = row["extra_info"]["api"], row["extra_info"]["stream"]
    options = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    if api == "chat":
        reply = await client.chat.completions.create(model="policy", messages=row["prompt"], **options)
    else:
        reply = await client.completions.create(model="policy", prompt=row["extra_info"]["text"], **options)
    if not stream:
        choice = reply.choices[0]
        text = choice.message.content if api == "chat" else choice.text
        return {"response": text, "extra_info": {"chunks": 1, "finish": choice.finish_reason,
                                                 "tokens": reply.usage.completion_tokens}}
    pieces, finish, usage = [], None, None
    async for chunk in reply:
        for choice in chunk.choices:
            piece = choice.delta.content if api == "chat" else choice.text
            pieces += [piece] if piece else []
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    return {"response": "".join(pieces), "extra_info": {"chunks": len(pieces), "finish": finish,
                                                        "tokens": usage.completion_tokens}}


def _question(tokenizer, tools=None) -> tuple[list[dict], list[int]]:
    messages = [{"role": "user", "content": QUESTION}]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return messages, tokenizer(text, add_special_tokens=False)["input_ids"]


def test_openai_harness_with_tools_gives_token_exact_trajectories_in_64_concurrent_sessions(engine, tool_caller):
    """64 sessions at once on one engine, each a harness calling the calculator through the
    OpenAI client: each trajectory is its own calls' tokens, with the template's tool turn between
    them masked out, never re-tokenized; the reply's call came back as OpenAI tool_calls."""
    from transformers import AutoModelForCausalLM

    tokenizer = engine.tokenizer
    messages, prompt_ids = _question(tokenizer, TOOLS)
    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=100, max_response_tokens=200)
    columns = asyncio.run(engine.rollout([(0, prompt_ids, {"prompt": messages})], "openai", 64, sampling, seed=3))
    trajectories = columns.unpack({0: prompt_ids})

    assert not columns.own_prompts and not any(t.dropped or t.prefix_breaks for t in trajectories)
    turns = ChatTurns(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(tool_caller, dtype=torch.float32)
    multi_turn = [t for t in trajectories if t.num_turns == 2]
    assert len(multi_turn) >= 32, [t.text for t in trajectories]
    for trajectory in trajectories:
        assert_engine_logprobs(model, trajectory)
    for trajectory in multi_turn:
        first_turn = _first_run(trajectory.response_mask, 1)
        call_ids = trajectory.response_ids[:first_turn]
        [call] = HermesParser().parse(tokenizer.decode(call_ids))
        tool_turn = [{"role": "tool", "content": calculator(**call.arguments)}]
        between = turns.after_turn(call_ids) + turns.next_turn(tool_turn)
        assert trajectory.response_ids[first_turn:first_turn + len(between)] == between
        assert trajectory.response_mask == [1] * first_turn + [0] * len(between) + [1] * (
            len(trajectory.response_ids) - first_turn - len(between))
        assert trajectory.tool_calls == 1 and trajectory.reward_info["num_turns"] == 2
    assert sum(t.text == "408" for t in multi_turn) >= len(multi_turn) // 2, [t.text for t in multi_turn]


def test_a_streamed_call_samples_and_records_what_the_unstreamed_call_does(engine):
    """Through the OpenAI client's streaming API: the calculator harness streaming every call
    (its tool calls arrive as tool-call deltas) gives the trajectories of the harness that does
    not, token for token; a reply without tools arrives in pieces as it is sampled, on chat and on
    completions, the pieces joined being the unstreamed reply, with its finish reason and usage."""
    tokenizer = engine.tokenizer
    messages, prompt_ids = _question(tokenizer, TOOLS)
    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=100, max_response_tokens=200)

    def rollout(loop: str, row: dict) -> list[Trajectory]:
        return asyncio.run(engine.rollout([(0, prompt_ids, row)], loop, 8, sampling, seed=5)).unpack({0: prompt_ids})

    plain, streamed = rollout("openai", {"prompt": messages}), rollout("streaming", {"prompt": messages})
    assert sum(t.tool_calls for t in streamed) >= 4 and not any(t.dropped for t in streamed)
    for a, b in zip(plain, streamed):
        assert (a.prompt_ids, a.response_ids, a.response_mask, a.text, a.num_turns, a.tool_calls) == \
            (b.prompt_ids, b.response_ids, b.response_mask, b.text, b.num_turns, b.tool_calls)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)  # batches differ: float sums move

    text, _ = _question_text(tokenizer, QUESTION)
    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=24, max_response_tokens=24)
    for api in ("chat", "completions"):
        plain, streamed = (rollout("text", {"prompt": [{"role": "user", "content": QUESTION}],
                                            "extra_info": {"api": api, "text": text, "stream": stream}})
                           for stream in (False, True))
        for a, b in zip(plain, streamed):
            assert (a.response_ids, a.text) == (b.response_ids, b.text) and not b.dropped
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)  # batches differ: float sums move
            assert b.reward_info["finish"] == a.reward_info["finish"] == a.finish_reason
            assert b.reward_info["tokens"] == len(b.response_ids)
            assert b.reward_info["chunks"] > 1 or len(b.response_ids) <= 2, (api, b.text)
        assert max(t.reward_info["chunks"] for t in streamed) >= 3, api


def test_openai_harness_that_rewrites_its_history_keeps_every_segment(engine):
    """A call that does not continue the session's tokens starts a new segment, counted as a prefix
    break: the episode is the first call's segment (the row's prompt) and the last (the prompt the
    harness rendered), each with its own sampled tokens and log-probs, and survives the trip
    between actors as columns; the reward's text is the last segment's."""
    tokenizer = engine.tokenizer
    messages, prompt_ids = _question(tokenizer)
    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=8, max_response_tokens=16)
    columns = asyncio.run(engine.rollout([(0, prompt_ids, {"prompt": messages})], "edits", 2, sampling, seed=1))
    trajectories = columns.unpack({0: prompt_ids})
    _, edited_ids = _question_text(tokenizer, QUESTION + " ")
    for trajectory in trajectories:
        [first] = trajectory.earlier
        assert trajectory.prefix_breaks == 1 and trajectory.num_turns == 2 and first.num_turns == 1
        assert first.prompt_ids == prompt_ids and trajectory.prompt_ids == edited_ids != prompt_ids
        for segment in (first, trajectory):
            assert segment.response_mask == [1] * len(segment.response_ids) and 1 <= len(segment.response_ids) <= 4
            assert len(segment.logprobs) == len(segment.response_ids)
        assert trajectory.text == tokenizer.decode(trajectory.response_ids, skip_special_tokens=True)
        assert [s.prompt_ids for s in trajectory.segments()] == [prompt_ids, edited_ids]
        assert trajectory.segments("last") == [trajectory]


def test_a_context_hook_that_rewrites_the_history_starts_a_new_segment(engine, calculator_tools):
    """The tool loop hands the hook the conversation before each turn after the first; the hook
    here drops the question after the tool's answer, so the second turn's prompt is the template's
    rendering of what it returned, and the first turn (the call) is the episode's earlier segment,
    with the prompt the row began with. A hook that raises leaves the history as it is."""
    tokenizer = engine.tokenizer
    schemas = [s.schema for s in calculator_tools]
    messages, prompt_ids = _question(tokenizer, schemas)
    seen = []

    def forget_the_question(history: list[dict], tokenizer) -> list[dict]:
        seen.append(history)
        return [m for m in history if m["role"] != "user"] if history[-1]["role"] == "tool" else history

    def broken(history: list[dict], tokenizer) -> list[dict]:
        raise RuntimeError("a bug in the user's hook")

    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=100, max_response_tokens=200)
    bound = type(engine.loops["tool"]).bind
    engine.loops["hooked"] = bound(forget_the_question)(engine.loops["tool"].context)
    engine.loops["broken"] = bound(broken)(engine.loops["tool"].context)
    try:
        columns = asyncio.run(engine.rollout([(0, prompt_ids, {"prompt": messages})], "hooked", 4, sampling, seed=5))
        unhooked = asyncio.run(engine.rollout([(0, prompt_ids, {"prompt": messages})], "broken", 4, sampling,
                                              seed=5)).unpack({0: prompt_ids})
    finally:
        del engine.loops["hooked"], engine.loops["broken"]
    assert not any(t.earlier for t in unhooked) and sum(t.tool_calls for t in unhooked) >= 3  # as if it had none
    episodes = [t for t in columns.unpack({0: prompt_ids}) if t.tool_calls == 1]
    assert len(episodes) >= 3 and len(seen) >= len(episodes)
    for episode in episodes:
        [call] = episode.earlier
        assert call.prompt_ids == prompt_ids and call.response_mask == [1] * len(call.response_ids)
        [parsed] = HermesParser().parse(tokenizer.decode(call.response_ids))
        kept = [{"role": "assistant", "content": tokenizer.decode(call.response_ids, skip_special_tokens=True)},
                {"role": "tool", "content": calculator(**parsed.arguments)}]
        assert episode.prompt_ids == tokenizer(tokenizer.apply_chat_template(
            kept, tools=schemas, tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        assert episode.response_mask == [1] * len(episode.response_ids) and episode.num_turns == 2
    assert sum(h[0] == messages[0] for h in seen) >= len(episodes)  # each episode's first history is the row's


def test_drop_tool_outputs_drops_the_oldest_outputs_until_the_history_fits(engine):
    """The built-in hook blanks the oldest tool outputs one at a time until the conversation fits
    its budget, keeps the newest output whatever the budget, and leaves a history that fits as it is."""
    from rlsys.agents.context_hooks import DROPPED_OUTPUT, resolve_context_hook
    from rlsys.data.examples import chat_ids

    tokenizer = engine.tokenizer
    history = [{"role": "user", "content": QUESTION}]
    for result in ("1" * 40, "2" * 40, "3" * 40):
        history += [{"role": "assistant", "content": "calling"}, {"role": "tool", "content": result}]
    size = lambda messages: len(chat_ids(messages, tokenizer, add_generation_prompt=True))  # noqa: E731
    outputs = lambda messages: [m["content"] for m in messages if m["role"] == "tool"]  # noqa: E731
    assert resolve_context_hook("drop_tool_outputs", size(history))(history, tokenizer) == history
    one_dropped = resolve_context_hook("drop_tool_outputs", size(history) - 1)(history, tokenizer)
    assert outputs(one_dropped) == [DROPPED_OUTPUT, "2" * 40, "3" * 40] and outputs(history)[0] == "1" * 40
    all_but_the_newest = resolve_context_hook("drop_tool_outputs", 1)(history, tokenizer)
    assert outputs(all_but_the_newest) == [DROPPED_OUTPUT] * 2 + ["3" * 40]


def _question_text(tokenizer, question: str) -> tuple[str, list[int]]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


def test_openai_completions_endpoint_records_the_prompt_tokens(engine):
    tokenizer = engine.tokenizer
    text, prompt_ids = _question_text(tokenizer, "7*8=")
    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=32, max_response_tokens=32)
    rows = [(0, [1, 2], {"extra_info": {"text": text}})]  # the harness writes its own prompt
    [trajectory] = asyncio.run(engine.rollout(rows, "completions", 1, sampling, seed=0)).unpack({0: [1, 2]})
    assert trajectory.prompt_ids == prompt_ids and 1 <= len(trajectory.response_ids) <= 6
    assert trajectory.text == tokenizer.decode(trajectory.response_ids, skip_special_tokens=True)
    assert trajectory.reward_info["finish"] in ("stop", "length")


def test_failing_harnesses_drop_their_samples_and_say_why(engine):
    """A harness that raises, hangs past its time (20 s here: a first call through a new endpoint took
    over 1 s on a loaded machine, and the harness that finishes must never reach it), returns neither a
    string nor a dict, or never calls the endpoint makes no trajectory; the others of the batch are
    unaffected."""
    messages, prompt_ids = _question(engine.tokenizer)
    modes = ["raise", "hang", "bad_return", "silent", "fine"]
    rows = [(i, prompt_ids, {"prompt": messages, "extra_info": {"mode": mode}}) for i, mode in enumerate(modes)]
    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=4, max_response_tokens=8)
    trajectories = asyncio.run(engine.rollout(rows, "failing", 1, sampling, seed=0)).unpack(
        {i: prompt_ids for i in range(len(modes))})
    assert [t.dropped for t in trajectories] == ["error", "timeout", "error", "no_call", ""]
    assert trajectories[-1].text == "the answer" and len(trajectories[-1].response_ids) <= 2


def test_the_endpoint_needs_its_token_and_listens_on_the_node_address_only(engine):
    """Requests without the token, or with another, are refused (401); a session that is not open is
    not found (404), a streamed call without it sends no event; the server binds the node's address,
    not 0.0.0.0."""
    import aiohttp
    import openai
    import ray

    endpoint = engine.loops["openai"].endpoint
    messages, prompt_ids = _question(engine.tokenizer)
    request = RolloutRequest(0, prompt_ids, 0, 0, {"prompt": messages})
    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=4, max_response_tokens=8)

    async def probe():
        url = await endpoint.start()
        session_id, _ = endpoint.open(request, sampling)
        body = {"model": "policy", "messages": messages}
        statuses = {}
        async with aiohttp.ClientSession() as http:
            for name, headers in [("none", {}), ("wrong", {"Authorization": "Bearer not-the-token"}),
                                  ("right", {"Authorization": f"Bearer {endpoint.token}"})]:
                async with http.get(f"{url}/v1/models", headers=headers) as reply:
                    statuses[f"models/{name}"] = reply.status
                async with http.post(f"{url}/s/{session_id}/v1/chat/completions", json=body, headers=headers) as reply:
                    statuses[f"chat/{name}"] = reply.status
            right = {"Authorization": f"Bearer {endpoint.token}"}
            async with http.post(f"{url}/s/closed/v1/chat/completions", json=body, headers=right) as reply:
                statuses["unknown session"] = reply.status
            for name, headers in [("none", {}), ("right", right)]:  # a streamed call is refused before it starts
                async with http.post(f"{url}/s/{session_id}/v1/chat/completions", json={**body, "stream": True},
                                     headers=headers) as reply:
                    statuses[f"stream/{name}"] = reply.status
                    statuses[f"stream/{name} events"] = "data: " in await reply.text()
        wrong_key = openai.AsyncOpenAI(base_url=f"{url}/s/{session_id}/v1", api_key="not-the-token", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await wrong_key.chat.completions.create(model="policy", messages=messages)
        await wrong_key.close()
        endpoint.close(session_id)
        return url, statuses

    url, statuses = asyncio.run(probe())
    assert statuses == {"models/none": 401, "chat/none": 401, "models/wrong": 401, "chat/wrong": 401,
                        "models/right": 200, "chat/right": 200, "unknown session": 404,
                        "stream/none": 401, "stream/none events": False,
                        "stream/right": 200, "stream/right events": True}
    assert url.removeprefix("http://").rsplit(":", 1)[0] == ray.util.get_node_ip_address()


@pytest.mark.quick
def test_a_tool_module_that_fails_inside_reports_its_own_error(tmp_path):
    """VeRL's `class_name: verl.tools.<name>.Class` finds `<name>.py` beside the YAML; when that
    module's own import fails (an installed VeRL missing `tensordict`, say), the error says so
    rather than that the module cannot be found."""
    from rlsys.config.loader import ConfigError

    (tmp_path / "broken_tool.py").write_text("import no_such_dependency_xyz\n")
    config = tmp_path / "tools.yaml"
    config.write_text("tools: [{class_name: verl.tools.broken_tool.Tool}]")
    with pytest.raises(ConfigError, match="importing verl.tools.broken_tool failed: ModuleNotFoundError: No module "
                                          "named 'no_such_dependency_xyz'"):
        load_tools([], str(config))
    config.write_text("tools: [{class_name: verl.tools.absent_tool.Tool}]")
    with pytest.raises(ConfigError, match="cannot find module 'verl.tools.absent_tool'"):
        load_tools([], str(config))
