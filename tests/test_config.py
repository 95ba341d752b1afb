"""Bad configs end with exit code 2 and one line naming the key; --help works."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from rlsys.config import peer_names
from rlsys.config.docs import config_rows
from rlsys.config.loader import ConfigError, load_config
from rlsys.config.schema import EvalJobConfig, RLJobConfig, TrainJobConfig
from rlsys.run import main

pytestmark = pytest.mark.quick  # the quick tier (scripts/test.sh --quick)

RL_CONFIG = str(pathlib.Path(__file__).resolve().parents[1] / "examples" / "arith" / "rlvr.yaml")


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["optim.lrr=0.1"], "optim.lrr: unknown config key; did you mean 'optim.lr'?"),
        (["trian.steps=3"], "trian: unknown config key; did you mean 'train'?"),
        (["train.steps=many"], "train.steps: Input should be a valid integer"),
        (["optim.lr=-1"], "optim.lr: Input should be greater than 0"),
        (["tracking.backends=[console, slack]"], "tracking.backends.1: Input should be"),
        (["model.path=/no/such/model"], "model.path: not a Hugging Face model directory"),
        (["data.train_files=[/no/such.jsonl]"], "data.train_files[0]: file not found: /no/such.jsonl"),
        (["train.global_batch_size=18"], "train.global_batch_size: 18 is not divisible by train.micro_batch_size (4)"),
        (["train.micro_batch_tokens=64", "train.global_batch_size=15"],
         "train.global_batch_size: 15 is not divisible by the data-parallel size (2)"),
        (["train.micro_batch_tokens=0"], "train.micro_batch_tokens: Input should be greater than 0"),
        (["eval.files=[]"], "eval.files: at least one file is required"),
        (["optim.lr"], "override 'optim.lr': expected dotted.key=value"),
        (["parallel.ep=2"], "parallel.ep: 2 expert-parallel ranks for a model without experts (qwen2)"),
        (["parallel.ep=3"], "parallel.ep: 3 does not divide dp_shard x cp x tp = 2, the ranks the experts are"),
    ],
)
def test_bad_config_exits_2_with_one_line(capsys, sft_config, overrides, expected):
    code, err = run_cli(capsys, "sft", "--config", sft_config.path, *overrides)
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert expected in err


@pytest.mark.parametrize(("overrides", "expected"), [
    (["parallel.dp_shard=3", "parallel.ep=3", "ray.num_cpus=3"],
     "parallel.ep: 3 does not divide the model's 8 experts"),
    (["parallel.dp_shard=1", "parallel.ep=2"], "parallel.ep: 2 does not divide dp_shard x cp x tp = 1"),
])
def test_bad_expert_parallel_layout_exits_2_with_one_line(capsys, sft_config, moe_model_dir, overrides, expected):
    code, err = run_cli(capsys, "sft", "--config", sft_config.path, f"model.path={moe_model_dir}", *overrides)
    assert (code, len(err.splitlines())) == (2, 1), err
    assert expected in err


def test_an_moe_family_rlsys_does_not_shard_exits_2(capsys, sft_config, moe_model_dir, tmp_path):
    import shutil

    other = tmp_path / "olmoe"
    shutil.copytree(moe_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config.update(model_type="olmoe", architectures=["OlmoeForCausalLM"])
    (other / "config.json").write_text(json.dumps(config))
    code, err = run_cli(capsys, "sft", "--config", sft_config.path, f"model.path={other}")
    assert code == 2 and "model.path: MoE model type 'olmoe' is not supported" in err, err


def test_missing_and_invalid_config_files(capsys, tmp_path):
    code, err = run_cli(capsys, "pretrain", "--config", str(tmp_path / "absent.yaml"))
    assert (code, err.count("\n")) == (2, 0) and "file not found" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    code, err = run_cli(capsys, "pretrain", "--config", str(bad))
    assert code == 2 and "not valid YAML at line" in err


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("eval.reward=nope", "eval.reward: unknown reward 'nope'"),
        ("algorithm.ppo_mini_batch_size=3", "algorithm.ppo_mini_batch_size: 3 does not divide train.prompts_per_step"),
        ("rollout.tensor_parallel_size=3", "rollout.tensor_parallel_size: 3 does not split the model's 2 attention"),
        ("algorithm.kl_estimator=k4", "algorithm.kl_estimator: Input should be 'k1', 'k2', 'k3', 'kl', 'mse', "
                                       "'low_var_kl' or 'abs'"),
        ("reward.terms=[{weight: 1.0}]", "reward.terms[0]: give a registered name, a path or a model"),
        ("model.random_init=true", "model.random_init: this stage samples from the model"),
        ("reward.terms=[]", "reward.terms: empty; name at least one reward (registered: arith, calc, code_exec"),
        ("eval.reward=''", "eval.reward: empty; name the reward that judges a response"),
        ("reward.overlong_buffer_len=99", "reward.overlong_buffer_len: 99 must be below the response budget"),
        (("algorithm.rollout_correction.rollout_is=token", "rollout.top_p=0.9"),
         "rollout.top_p: below 1 the engine's log-probs"),
        (("algorithm.filter_groups=true", "rollout.n=1"), "algorithm.filter_groups: needs groups of rollout.n >= 2"),
        ("algorithm.router_replay=r2", "algorithm.router_replay: the model has no MoE layers to replay"),
        (("algorithm.distill.teacher=MODEL", "algorithm.distill.top_k=4", "algorithm.distill.mode=penalty"),
         "algorithm.distill.top_k: the top-k KL is a loss term; mode: penalty puts"),
        ("algorithm.distill.top_k=21", "algorithm.distill.top_k: Input should be less than or equal to 20"),
        (("algorithm.distill.teacher=MODEL", "algorithm.distill.serving.engine_memory_gib=1e-6"),
         "algorithm.distill.serving.engine_memory_gib: one sequence of 26 tokens needs"),  # the rollout's, and 1
        ("critic.warmup_steps=3", "critic.warmup_steps: there is no critic unless"),
        ("train.async_mode=one_step", "train.async_mode: one_step generates while the trainer updates"),
        ("train.replay=runs/none", "train.replay: a synchronous run repeats itself without a schedule"),
        (("train.replay=runs/none", "train.async_mode=full", "rollout.placement=separate"),
         "train.replay: cannot read a schedule from runs/none"),
        (("train.replay=runs/here", "output_dir=runs/here", "train.async_mode=full", "rollout.placement=separate"),
         "train.replay: runs/here is this run's own schedule"),
        ("rollout.block_size=48", "rollout.block_size: 48 tokens; on CPU a multiple of 32"),
        ("rollout.temperature=3", "rollout.temperature: Input should be less than or equal to 2 (got 3)"),
        ("rollout.agent_loop=tool", "rollout.agent_loop: the tool loop calls tools; give tools.names"),
        ("rollout.agent_loop=nope.py:Loop", "rollout.agent_loop: file not found"),
        ("rollout.agent_loop=openai", "rollout.agent_loop: the openai loop runs an agent harness; give "
                                      "rollout.agent_entry"),
        (("rollout.agent_loop=openai", "rollout.agent_entry=tests/assets/openai_harness.py:not_async"),
         "rollout.agent_entry: " + os.path.abspath("tests/assets/openai_harness.py") + " has no async function"),
        ("rollout.context_hook=drop_tool_outputs", "rollout.context_hook: the tool loop runs a context hook, not "
                                                   "single_turn"),
        (("rollout.agent_loop=tool", "tools.names=[calculator]", "rollout.context_hook=drop_old"),
         "rollout.context_hook: 'drop_old' is neither a built-in hook (drop_tool_outputs) nor path/to/file.py"),
        (("rollout.agent_loop=openai", "rollout.agent_entry=tests/assets/openai_harness.py:run",
          "algorithm.adv_estimator=gae"), "rollout.train_segments: gae's critic returns are per segment"),
        ("algorithm.rollout_correction.preset=bypass_nope", "algorithm.rollout_correction.preset: unknown "
                                                            "'bypass_nope'; VeRL's: decoupled_token_is"),
        (("algorithm.rollout_correction.preset=bypass_pg_is", "algorithm.rollout_correction.rollout_is=token"),
         "algorithm.rollout_correction.rollout_is: the preset bypass_pg_is sets it to 'sequence'; drop one of them"),
        (("algorithm.rollout_correction.bypass_mode=true", "algorithm.policy_loss=cispo"),
         "algorithm.policy_loss: bypass mode picks its loss by rollout_correction.loss_type"),
        (("algorithm.rollout_correction.bypass_mode=true", "algorithm.old_logprobs=trainer"),
         "algorithm.old_logprobs: bypass mode takes the engine's log-probs as the old ones, not trainer's"),
        (("algorithm.rollout_correction.rollout_is=token", "algorithm.old_logprobs=rollout"),
         "algorithm.rollout_correction: with old_logprobs: rollout every ratio is 1"),
        ("algorithm.rollout_correction.rollout_is_batch_normalize=true",
         "algorithm.rollout_correction.rollout_is_batch_normalize: normalises the importance weights"),
        (("algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_is=token",
          "algorithm.rollout_correction.rollout_is_batch_normalize=true"),
         "algorithm.rollout_correction.rollout_is_batch_normalize: in bypass mode the weights follow the policy"),
    ],
)
def test_rlvr_bad_config_names_the_key(capsys, tiny_model_dir, arith_files, override, expected):
    code, err = run_cli(capsys, "rlvr", "--config", RL_CONFIG, f"model.path={tiny_model_dir}",
                        f"data.train_files=[{arith_files['rl_train']}]", f"eval.files=[{arith_files['test']}]",
                        *(o.replace("MODEL", tiny_model_dir)
                          for o in (override if isinstance(override, tuple) else (override,))))
    assert code == 2 and len(err.splitlines()) == 1 and expected in err, err


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (("algorithm.router_replay=r3",), "algorithm.router_replay: r3 needs the rollout engines' routing, which vLLM "
                                          "returns only on a GPU"),
        (("algorithm.router_replay=r3", "ray.gpus_per_worker=1", "rollout.agent_loop=openai",
          "rollout.agent_entry=tests/assets/openai_harness.py:run"), "algorithm.router_replay: r3 not with "
                                                                         "rollout.agent_loop: openai"),
        (("algorithm.router_replay=r2", "algorithm.old_logprobs=rollout"), "algorithm.router_replay: r2 records"),
    ],
)
def test_routing_replay_a_job_cannot_run_exits_2(capsys, moe_model_dir, arith_files, overrides, expected):
    code, err = run_cli(capsys, "rlvr", "--config", RL_CONFIG, f"model.path={moe_model_dir}",
                        f"data.train_files=[{arith_files['rl_train']}]", f"eval.files=[{arith_files['test']}]",
                        *overrides)
    assert code == 2 and len(err.splitlines()) == 1 and expected in err, err


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ("tools: 5", "needs a `tools:` list"),
        ("- class_name: a.B", "needs a `tools:` list"),
        ("tools: [5]", "tools[0]: a mapping with class_name"),
        ("tools: [{class_name: 3}]", "tools[0].class_name: a string"),
        ("tools: [{class_name: a.B, config: 5}]", "tools[0].config: a mapping is needed, got int"),
        ("tools: [{class_name: a.B, tool_schema: {function: [1]}}]", "tools[0].tool_schema.function: a mapping"),
        ("tools: [{class_name: nowhere.Tool}]", "tools[0].class_name: cannot find module 'nowhere'"),
        ("tools: [", "is not valid YAML"),
    ],
)
def test_a_tool_yaml_of_the_wrong_shape_names_the_file_and_key(capsys, tmp_path, tiny_model_dir, arith_files,
                                                               document, expected):
    path = tmp_path / "tools.yaml"
    path.write_text(document)
    code, err = run_cli(capsys, "rlvr", "--config", RL_CONFIG, f"model.path={tiny_model_dir}",
                        f"data.train_files=[{arith_files['rl_train']}]", f"eval.files=[{arith_files['test']}]",
                        "rollout.agent_loop=tool", f"tools.config_file={path}")
    assert code == 2 and len(err.splitlines()) == 1 and expected in err and "tools.config_file" in err, err


def test_valid_config_types_and_defaults(sft_config):
    cfg = sft_config("optim.betas=[0.8, 0.9]", "train.steps=7")
    assert isinstance(cfg, TrainJobConfig)
    assert cfg.optim.betas == (0.8, 0.9) and cfg.train.steps == 7 and cfg.train.resume is True


@pytest.mark.parametrize(
    ("schema", "overrides", "expected"),
    [
        (RLJobConfig, [], 8),
        (RLJobConfig, ["parallel.dp_shard=2", "parallel.tp=2"], 2),
        (RLJobConfig, ["parallel.dp_shard=16"], 1),
        (RLJobConfig, ["rollout.placement=separate", "rollout.num_engines=2", "rollout.cpus_per_engine=2"], 4),
        (RLJobConfig, ["ray.num_cpus=4"], 4),
        (RLJobConfig, ["ray.num_cpus=64", "parallel.pp=2"], 4),
        (RLJobConfig, ["ray.cpus_per_worker=3"], 3),
        (TrainJobConfig, ["parallel.dp_shard=2"], 4),
        (EvalJobConfig, [], 8),
    ],
)
def test_cpus_per_worker_defaults_to_the_cores_over_the_ranks(monkeypatch, schema, overrides, expected):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert load_config(schema, None, overrides).ray.cpus_per_worker == expected


def test_cpus_per_worker_is_1_on_a_joined_cluster(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert load_config(RLJobConfig, None, []).ray.cpus_per_worker == 1


def test_config_error_is_a_value_error_naming_the_key(sft_config):
    with pytest.raises(ConfigError, match=r"^parallel\.dp_shard: "):
        sft_config("parallel.dp_shard=0")


def test_real_cli_prints_no_traceback(sft_config):
    result = subprocess.run(
        [sys.executable, "-m", "rlsys.run", "sft", "--config", sft_config.path, "train.stepz=3"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "rlsys sft: error: train.stepz: unknown config key; did you mean 'train.steps'?"
    )


@pytest.mark.parametrize("argv", [["--help"], ["sft", "--help"], ["eval", "--help"]])
def test_help_at_both_levels(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    assert "usage: python -m rlsys.run" in capsys.readouterr().out


@pytest.mark.parametrize("typed", list(peer_names.PEER_NAMES))
def test_a_verl_or_trl_key_is_answered_with_rlsys_name(typed):
    """Each name of the table, typed as an override of an RL job (a TRL field also under a section),
    ends in one line giving rlsys's name; each rlsys key the table gives exists."""
    entry = peer_names.PEER_NAMES[typed]
    for schema, target in ((RLJobConfig, entry.rl), (TrainJobConfig, entry.in_training_job)):
        schema = RLJobConfig if target.endswith("(in an RL job)") else schema
        rows = {key.replace("[]", "") for key, *_ in config_rows(schema)}
        named = target.split(" ")[0]
        if re.fullmatch(r"[a-z_]+(\.[a-z_\[\]]+)*", named) and named not in ("none:", "the"):
            assert named.replace("[]", "") in rows or any(row.startswith(named + ".") for row in rows), target
    typed_as = [typed] if "." in typed else [typed, f"rollout.{typed}"]
    for key in typed_as:
        with pytest.raises(ConfigError) as err:
            load_config(RLJobConfig, None, [f"{key}=1"])
        whose = f"{entry.peer}'s name" if key == typed else f"{typed} is {entry.peer}'s name"
        assert str(err.value) == f"{key}: {whose}; rlsys's: {entry.rl}"


def test_the_peer_names_table_is_current():
    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    block = re.search(r"<!-- peer-names:start -->\n(.*)<!-- peer-names:end -->", text, re.S)
    assert block and block.group(1) == peer_names.markdown(), "regenerate with: peer_names.markdown()"
