"""A real pretrained model through the paths a character-level tokenizer cannot test.

SmolLM2-135M-Instruct cut to its first 2 layers (`smollm2_cut_dir`): real weights, a byte-level
BPE tokenizer of 49,152 tokens whose ChatML template inserts a default system prompt, pad equal
to eos, an LM head tied to the embedding, 9 heads and 3 key/value heads. Through it: the GGUF
conversion and its refusals, SFT targets under the real template, tensor parallel at tp=3
against one process, GRPO with full weights and with LoRA (the engine samples what the
trainer scores, exports load in transformers and vLLM), the tool loop, and the OpenAI
endpoint's recording where decoded text re-encodes to other ids.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import QUESTION, teach_tool_call
from parity import (
    MICRO_BATCH,
    assert_layout_matches_single_process,
    parity_batches,
)
from test_agents import TOOLS, assert_engine_logprobs, assert_tool_trajectories, calculator_agent
from test_rlvr import COIN, metrics
from test_train_resume_export import stored_names
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlsys.agents.chat import ChatTurns
from rlsys.agents.openai_loop import OpenAILoop
from rlsys.agents.trajectory import Sampling
from rlsys.config.loader import build_config
from rlsys.config.rollout import RolloutConfig, ToolsConfig
from rlsys.config.schema import RLJobConfig
from rlsys.config.training import DataConfig
from rlsys.data.examples import sft_example
from rlsys.models.gguf import GGUFError, convert
from rlsys.stages.rl_trainer import run_rlvr
from rlsys.tasks.extremes import ExtremesSpec, write_splits

# One xdist worker runs this module (scripts/test.sh): the real model's tool caller and its engine, built once.
pytestmark = pytest.mark.xdist_group("real_model")

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
TEMPERATURE = 2.0
"""The drift test's sampling temperature: the tool-calling cut is sure of its trained trace at T=1;
hotter, it samples the odd token sequences a BPE tokenizer would not produce from their text."""


@pytest.fixture(scope="module")
def tokenizer(smollm2_cut_dir):
    return AutoTokenizer.from_pretrained(smollm2_cut_dir)


@pytest.mark.quick
def test_the_converted_model_is_the_real_one_cut(smollm2_cut_dir, tokenizer):
    with open(os.path.join(smollm2_cut_dir, "config.json")) as f:
        config = json.load(f)
    assert (config["model_type"], config["num_hidden_layers"], config["tie_word_embeddings"]) == ("llama", 2, True)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (9, 3, 49152)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id == tokenizer.eos_token_id
    assert tokenizer.convert_ids_to_tokens(tokenizer("Hello world")["input_ids"]) == ["Hello", "Ġworld"]
    model = AutoModelForCausalLM.from_pretrained(smollm2_cut_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.quick
def test_gguf_files_it_cannot_read_are_refused_in_one_line(tmp_path):
    import gguf
    import numpy as np

    unknown = str(tmp_path / "unknown.gguf")
    writer = gguf.GGUFWriter(unknown, "nosucharch")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    unsupported = r"architecture nosucharch is not supported yet.* \(transformers reads: .*llama"
    with pytest.raises(GGUFError, match=unsupported):
        convert(unknown, str(tmp_path / "out"))
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        convert(str(tmp_path / "text.gguf"), str(tmp_path / "out"))
    result = subprocess.run([sys.executable, "-m", "rlsys.models.gguf", "--gguf", str(tmp_path / "absent.gguf"),
                             "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"rlsys gguf: error: {tmp_path / 'absent.gguf'}: no such file"]
    assert not (tmp_path / "out").exists()


@pytest.mark.quick
def test_sft_targets_each_assistant_turn_through_its_end_token(tokenizer):
    """The template's default system prompt is in the prompt; each assistant turn is a target up to
    `<|im_end|>`, and the newline the template writes after it is not (the engine never samples it)."""
    messages = [{"role": "user", "content": "What is 12+7?"}, {"role": "assistant", "content": "19"},
                {"role": "user", "content": "And 3 apples plus 4?"}, {"role": "assistant", "content": "7 apples"}]
    example = sft_example({"messages": messages}, DataConfig(), tokenizer)
    targets = [t for t, m in zip(example.input_ids, example.loss_mask) if m]
    assert tokenizer.decode(targets) == "19<|im_end|>7 apples<|im_end|>"
    text = tokenizer.decode(example.input_ids)
    assert text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n") and text.endswith("7 apples<|im_end|>\n")
    own_system = sft_example({"messages": [{"role": "system", "content": "Be brief."}, *messages]}, DataConfig(),
                             tokenizer)
    assert SYSTEM not in tokenizer.decode(own_system.input_ids)


def test_tensor_parallel_3_gives_the_single_process_gradients(ray_cluster, sft_config, smollm2_cut_dir, arith_files):
    """tp=3 splits the 9 heads, the 3 key/value heads and the 49,152-token vocabulary of the tied
    embedding and LM head: the loss, every gradient (the tied weight's summing both uses) and the
    log-probs are one process's."""
    sft, rl, counts = parity_batches(smollm2_cut_dir, arith_files, max_seq_len=64)
    cfg = sft_config("parallel.dp_shard=1", "parallel.tp=3", f"train.micro_batch_size={MICRO_BATCH}",
                     f"model.path={smollm2_cut_dir}", "data.max_seq_len=64", "ray.cpus_per_worker=1")
    # log-probs down to -40 here: within 1e-4; gradients within 1e-4 (the distillation term's sums run over a
    # 49,152-token vocabulary: 3.5e-5 measured)
    sft_grads, local_shapes = assert_layout_matches_single_process(cfg, smollm2_cut_dir, sft, rl, counts, 1e-4, 1e-4)
    assert "lm_head.weight" not in sft_grads  # one tied parameter, as in one process
    assert [shapes["model.embed_tokens.weight"] for shapes in local_shapes] == [(16384, 576)] * 3


@pytest.fixture(scope="module")
def extremes_files(tmp_path_factory) -> dict[str, str]:
    return write_splits(str(tmp_path_factory.mktemp("extremes")), ExtremesSpec(num_rl=64, num_sft=8, num_test=8))


def real_rl_raw(model_dir: str, files: dict[str, str], output_dir: str) -> dict:
    """2 GRPO steps on 2 FSDP2 ranks and a colocated engine: 4 prompts x 4 responses of <= 8 tokens of
    the largest/smallest-number task's templated prompts."""
    return {
        "output_dir": output_dir,
        "model": {"path": model_dir},
        "data": {"train_files": [files["rl_train"]]},
        "rollout": {"n": 4, "max_new_tokens": 8, "engine_memory_gib": 0.1},
        "reward": {"terms": [{"path": COIN}]},  # the 2-layer cut solves nothing: random rewards move it
        "optim": {"lr": 1e-4},
        "train": {"steps": 2, "prompts_per_step": 4, "micro_batch_size": 8, "save_every": 0, "val_every": 0},
        "parallel": {"dp_shard": 2},
        "ray": {"include_dashboard": False},
        "tracking": {"backends": ["jsonl"]},
        "eval": {"files": [files["test"]], "reward": "extremes", "limit": 4, "max_new_tokens": 8},
    }


@pytest.mark.parametrize("lora_rank", [0, 8], ids=["full", "lora"])
def test_grpo_on_the_real_model_samples_what_the_trainer_scores_and_exports(ray_cluster, smollm2_cut_dir,
                                                                          extremes_files, tmp_path, lora_rank):
    """Every step the engine's log-prob of each sampled token (after the chat template's prompt)
    is the trainer's: at the start, and after the tied weights (or the adapters alone) are synced;
    the export loads in transformers with its head still tied, and vLLM serving it generates what
    transformers generates."""
    raw = real_rl_raw(smollm2_cut_dir, extremes_files, str(tmp_path / "run"))
    if lora_rank:
        raw["model"]["lora"] = {"rank": lora_rank, "alpha": 16.0}
        raw["optim"]["lr"] = 1e-3
    cfg = build_config(RLJobConfig, raw)
    run_rlvr(cfg)
    rows = metrics(cfg.output_dir)
    assert all(rows[step]["rollout/logprob_abs_diff"] < 1e-4 for step in (1, 2)), rows
    assert rows[2]["actor/grad_norm"] > 0
    if lora_rank:
        assert rows[2]["sync/mb"] < 10  # the adapters, not the 140 MB model

    exported = os.path.join(cfg.output_dir, "hf_model")
    assert_export_generates_as_transformers(exported, smollm2_cut_dir)


def assert_export_generates_as_transformers(exported: str, original: str) -> None:
    from vllm import SamplingParams

    from rlsys.rollout.vllm_engine import create_llm

    tokenizer = AutoTokenizer.from_pretrained(exported)
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert stored_names(exported) == stored_names(original)  # the tied head stored once, as the original
    before = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32)
    assert any((a - b).abs().max() > 0 for a, b in zip(model.parameters(), before.parameters()))  # it trained
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q in ("What is 12+7?", "Hi there!")]
    expected = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=6, do_sample=False)
        expected.append(out[0, ids["input_ids"].shape[1]:].tolist())
    llm = create_llm(exported, RolloutConfig(engine_memory_gib=0.1), seed=0)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected


# -- agents: the tool loop and the OpenAI endpoint on a byte-level BPE tokenizer ---------------------


async def follow_up_agent(client, row: dict) -> str:
    """Asks, then sends the reply back as the OpenAI SDK gives it with a follow-up question."""
    messages = list(row["prompt"])
    reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=12)
    messages += [reply.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "Say it again."}]
    again = await client.chat.completions.create(model="policy", messages=messages, max_tokens=12)
    return again.choices[0].message.content or ""


async def text_agent(client, row: dict) -> str:
    """Continues by text through /v1/completions: its second prompt is the first one, the reply's
    text and a newline, as a harness that keeps a transcript string does."""
    prompt = row["extra_info"]["text"]
    reply = await client.completions.create(model="policy", prompt=prompt, max_tokens=12)
    again = await client.completions.create(model="policy", prompt=prompt + reply.choices[0].text + "\n",
                                            max_tokens=12)
    return again.choices[0].text


@pytest.fixture(scope="module")
def real_tool_caller(smollm2_cut_dir, calculator_tools, tmp_path_factory) -> str:
    return teach_tool_call(smollm2_cut_dir, str(tmp_path_factory.mktemp("real_tool_caller")), calculator_tools,
                           lr=1e-3)


@pytest.fixture(scope="module")
def real_engine(real_tool_caller, calculator_tools, ray_cluster):
    """A rollout engine in this process on the tool-calling cut of SmolLM2: the tool loop, the
    calculator harness and the two harnesses above."""
    from rlsys.actors.rollout_worker import RolloutWorker, RolloutWorkerSpec
    from rlsys.actors.tool_pool import ToolPool
    from rlsys.agents.tool_loop import ToolLoop

    pool = ToolPool(calculator_tools, num_workers=1, timeout_s=10.0)  # far above a loaded machine's call
    loops = {"tool": ToolLoop, "openai": OpenAILoop.bind(calculator_agent, 60.0),
             "follow_up": OpenAILoop.bind(follow_up_agent, 60.0), "text": OpenAILoop.bind(text_agent, 60.0)}
    tools = ToolsConfig(names=["calculator"], max_turns=3, timeout_s=10.0)
    worker = RolloutWorker(RolloutWorkerSpec(real_tool_caller, RolloutConfig(engine_memory_gib=0.1, block_size=32),
                                             seed=0, num_threads=2, loops=loops, tools=tools, tool_client=pool.client(),
                                             tool_schemas=[s.schema for s in calculator_tools]))
    yield worker
    pool.shutdown()


def test_the_tool_loop_on_a_bpe_template_is_token_exact(real_engine, real_tool_caller, calculator_tools):
    """The prompt, the sampled call, the template's tool turn (`<|im_end|>`'s newline, the
    `<|im_start|>tool` turn, the next generation prompt) and the answer, with exact masks; the
    engine's log-prob of every sampled token is the model's."""
    assert_tool_trajectories(real_engine, real_tool_caller, calculator_tools, "tool")


def test_the_openai_endpoint_never_retokenizes_sampled_bpe_turns(real_engine, real_tool_caller):
    """64 two-turn chat sessions at T=1: a sampled reply that re-encodes to other ids when decoded
    (counted here) is still recorded as sampled, and the follow-up call continues the session (no
    prefix break). A harness that re-sends the transcript as text through /v1/completions breaks
    the session's prefix exactly where a decoded reply re-encodes to other ids, and each break is
    counted, never trained on as if it were sampled."""
    tokenizer, turns = real_engine.tokenizer, ChatTurns(real_engine.tokenizer)
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    sampling = Sampling(temperature=TEMPERATURE, top_p=1.0, max_new_tokens=12, max_response_tokens=64)
    row = {"prompt": messages, "extra_info": {"text": text}}

    chat = asyncio.run(real_engine.rollout([(0, prompt_ids, row)], "follow_up", 64, sampling, seed=7))
    trajectories = chat.unpack({0: prompt_ids})
    model = AutoModelForCausalLM.from_pretrained(real_tool_caller, dtype=torch.float32)
    drifted = 0
    for trajectory in trajectories:
        assert trajectory.prefix_breaks == 0 and not trajectory.dropped and trajectory.num_turns == 2
        first_turn = next(i for i, m in enumerate(trajectory.response_mask) if m == 0)
        sampled = trajectory.response_ids[:first_turn]
        between = turns.after_turn(sampled) + turns.next_turn([{"role": "user", "content": "Say it again."}])
        assert trajectory.response_ids[first_turn:first_turn + len(between)] == between
        drifted += _reencoded(tokenizer, sampled) != sampled
        assert_engine_logprobs(model, trajectory, TEMPERATURE)
    assert drifted > 0, "no sampled reply re-encoded to other ids: the check shows nothing"

    completions = asyncio.run(real_engine.rollout([(0, prompt_ids, row)], "text", 64, sampling, seed=7))
    breaks = 0
    for trajectory in completions.unpack({0: prompt_ids}):
        assert not trajectory.dropped and trajectory.prefix_breaks <= 1
        if trajectory.prefix_breaks:  # the re-sent transcript is the new segment's prompt, as the harness wrote it
            breaks += 1
            assert trajectory.prompt_ids[:len(prompt_ids)] == prompt_ids != trajectory.prompt_ids
            [first] = trajectory.earlier  # the first call's segment: the row's prompt and its reply
            assert first.prompt_ids == prompt_ids and trajectory.num_turns == 2 and first.num_turns == 1
        else:  # the reply re-encoded to its own ids: both calls in one segment, the newline masked
            first_turn = next(i for i, m in enumerate(trajectory.response_mask) if m == 0)
            reply = tokenizer.decode(trajectory.response_ids[:first_turn])
            resent = tokenizer(text + reply + "\n", add_special_tokens=False)["input_ids"]
            assert (trajectory.prompt_ids + trajectory.response_ids)[:len(resent)] == resent
        assert_engine_logprobs(model, trajectory, TEMPERATURE)
    print(f"\nBPE drift: {drifted} of {len(trajectories)} sampled replies re-encode to other ids; "
          f"a harness re-sending its transcript as text broke {breaks} of 64 sessions")
    assert breaks > 0


def _reencoded(tokenizer, ids: list[int]) -> list[int]:
    """What a framework that re-tokenizes text would train on: `ids` decoded and encoded again."""
    end = [tokenizer.eos_token_id] if ids and ids[-1] == tokenizer.eos_token_id else []
    body = ids[:len(ids) - len(end)]
    return tokenizer(tokenizer.decode(body), add_special_tokens=False)["input_ids"] + end


def test_the_calculator_harness_on_a_bpe_template_is_token_exact(real_engine, real_tool_caller):
    """The calculator example's OpenAI harness on the real template: the call comes back as
    OpenAI tool_calls, the harness's tool message becomes the template's tool turn, masked."""
    tokenizer = real_engine.tokenizer
    messages = [{"role": "user", "content": QUESTION}]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=100, max_response_tokens=200)
    columns = asyncio.run(real_engine.rollout([(0, prompt_ids, {"prompt": messages})], "openai", 8, sampling, seed=3))
    trajectories = columns.unpack({0: prompt_ids})
    model = AutoModelForCausalLM.from_pretrained(real_tool_caller, dtype=torch.float32)
    assert sum(t.num_turns == 2 and t.tool_calls == 1 for t in trajectories) >= 4, [t.text for t in trajectories]
    for trajectory in trajectories:
        assert trajectory.prefix_breaks == 0
        assert_engine_logprobs(model, trajectory)
