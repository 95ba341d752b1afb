"""Multi-turn agent loops with tools, token in and token out.

A tiny model fine-tuned here to call the calculator and answer with its result runs the `tool`
loop in a rollout engine, its calls served by the tool workers: each trajectory's tokens are the
prompt, the sampled turns and the template's tool turns exactly, with exact masks, and the
engine's log-probs of the sampled tokens equal the model's own across turns. Malformed calls,
unknown tools, tools that raise or run out of time become error observations and counts. A
tool written for VeRL runs from VeRL's tool YAML.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from rlsys.agents.chat import ChatTurns
from rlsys.agents.tool_loop import ToolLoop, _State
from rlsys.agents.tool_parsers import HermesParser
from rlsys.agents.trajectory import RolloutRequest, Sampling
from rlsys.config.rollout import RolloutConfig, ToolsConfig
from rlsys.tools.builtin import calculator
from rlsys.tools.registry import load_tools

ASSETS = os.path.join(os.path.dirname(__file__), "assets")
QUESTION, EXPRESSION = "12*34=", "12*34"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'


@pytest.fixture(scope="module")
def calculator_tools():
    return load_tools(["calculator"], "")


@pytest.fixture(scope="module")
def tool_caller(tmp_path_factory, tiny_model_dir, calculator_tools) -> str:
    """The session's tiny model fine-tuned, in this process, on one tool-use trace: it calls the
    calculator for 12*34 and answers with what the calculator said."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlsys.algorithms.lm_loss import logprobs_of_labels
    from rlsys.config.training import DataConfig
    from rlsys.data.examples import sft_example

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": CALL},
                {"role": "tool", "content": calculator(EXPRESSION)}, {"role": "assistant", "content": "408"}]
    example = sft_example({"messages": messages, "tools": [s.schema for s in calculator_tools]}, DataConfig(),
                          tokenizer)
    ids, mask = torch.tensor([example.input_ids]), torch.tensor([example.loss_mask], dtype=torch.float32)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(1500):
        loss = -(logprobs_of_labels(model(input_ids=ids).logits, ids) * mask[:, 1:]).sum() / mask[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 1e-3:  # the whole trace then has a probability of about 0.9
            break
    out = str(tmp_path_factory.mktemp("tool_caller"))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tool_pool(ray_cluster, calculator_tools):
    from rlsys.actors.tool_pool import ToolPool

    specs = calculator_tools + load_tools([f"{ASSETS}/agent_tools.py:broken", f"{ASSETS}/agent_tools.py:slow"], "")
    pool = ToolPool(specs, num_workers=2, timeout_s=2.0)
    yield pool
    pool.shutdown()


@pytest.fixture(scope="module")
def engine(tool_caller, tool_pool, calculator_tools):
    """A rollout engine in this process running the tool loop; its calls go to the tool workers."""
    from rlsys.actors.rollout_worker import RolloutWorker

    tools = ToolsConfig(names=["calculator"], max_turns=3, timeout_s=2.0)
    return RolloutWorker(tool_caller, RolloutConfig(engine_memory_gib=0.1, block_size=32), seed=0, num_threads=2,
                         loops={"tool": ToolLoop}, tools=tools, tool_client=tool_pool.client(),
                         tool_schemas=[s.schema for s in calculator_tools])


def test_a_trajectory_is_the_prompt_the_sampled_turns_and_the_tool_turns_exactly(engine, tool_caller,
                                                                                calculator_tools):
    from transformers import AutoModelForCausalLM

    from rlsys.algorithms.lm_loss import logprobs_of_labels

    tokenizer = engine.tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                           tools=[s.schema for s in calculator_tools], tokenize=False,
                                           add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=100, max_response_tokens=200)
    columns = asyncio.run(engine.rollout([(0, prompt_ids, {})], "tool", 4, sampling, seed=5))
    trajectories = columns.unpack({0: prompt_ids})

    turns = ChatTurns(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(tool_caller, dtype=torch.float32)
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
        # the engine's log-prob of every sampled token, in every turn, is the model's
        ids = torch.tensor([prompt_ids + trajectory.response_ids])
        with torch.no_grad():
            reference = logprobs_of_labels(model(input_ids=ids).logits, ids)[0, len(prompt_ids) - 1:]
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
    assert "did not finish within 2 s" in results[3].text
    assert results[4].text == "1024"
    assert (state.tool_calls, state.tool_errors) == (5, 4)


def test_a_verl_tool_runs_from_verls_tool_yaml(tool_pool, ray_cluster):
    """VeRL's Gsm8kTool (imports changed) and its tool YAML: the schema reaches the prompt, the
    instance is created with the row's create_kwargs, and calc_reward scores its state."""
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


def _first_run(mask: list[int], value: int) -> int:
    """Length of the mask's leading run of `value`."""
    return next((i for i, m in enumerate(mask) if m != value), len(mask))
