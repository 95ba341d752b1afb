"""A real SFT run on 2 tensor-parallel ranks, on 2 pipeline stages, on 2 context-parallel
ranks and of an MoE model on 2 expert-parallel ranks: resume reproduces the losses; the HF
export loads in transformers and vLLM, which generate the same tokens; the export command writes
any checkpointed step, in fp32 or bf16."""

from __future__ import annotations

import glob
import json
import os
import shutil
import stat

import pytest

from rlsys.stages.lm_trainer import run_lm_training

# One xdist worker runs this module (scripts/test.sh): the uninterrupted run of each layout, built once.
pytestmark = pytest.mark.xdist_group("train_resume_export")

STEPS = 6
LAYOUTS = {
    "tp2-sp-lp": {"tp": 2, "sequence_parallel": True, "loss_parallel": True},
    "pp2": {"pp": 2, "pp_schedule": "1f1b"},
    "cp2": {"cp": 2},
    "ep2-moe": {"dp_shard": 2, "ep": 2},
}


def losses(output_dir: str) -> dict[int, float]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return {row["step"]: row["train/loss"] for row in map(json.loads, f)}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def straight_run(request, ray_cluster, tiny_model_dir, moe_model_dir, arith_files, tmp_path_factory):
    """6 uninterrupted steps on 2 tensor-parallel ranks (sequence and loss parallel on), 2 pipeline
    stages, 2 context-parallel ranks or, of the MoE model, 2 expert-parallel ranks, checkpointing
    at steps 3 and 6. (FSDP2 resume is covered by the RLVR tests.)"""
    from rlsys.config.loader import build_config
    from rlsys.config.schema import TrainJobConfig

    out = str(tmp_path_factory.mktemp("straight"))
    cfg = build_config(TrainJobConfig, {
        "output_dir": out,
        "model": {"path": moe_model_dir if request.param.endswith("moe") else tiny_model_dir},
        "data": {"train_files": [arith_files["sft"]], "max_seq_len": 32},
        "optim": {"lr": 1e-3, "warmup_steps": 2},
        "train": {"steps": STEPS, "global_batch_size": 16, "micro_batch_size": 4, "save_every": 3},
        "parallel": LAYOUTS[request.param],
        "ray": {"include_dashboard": False},
        "tracking": {"backends": ["jsonl", "tensorboard"]},
    })
    summary = run_lm_training(cfg, "sft")
    return cfg, summary


def test_output_directory_layout(straight_run):
    cfg, summary = straight_run
    out = cfg.output_dir
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["step_000003", "step_000006"]
    weights = "hf_model/model.safetensors" if cfg.parallel.pp == 1 else "hf_model/model.safetensors.index.json"
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "report.png", "report.html",
                 "hf_model/config.json", weights, "hf_model/tokenizer.json"):
        assert os.path.isfile(os.path.join(out, name)), name
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(os.path.join(out, "hf_model")):  # readable as the umask says, the weights too
        assert stat.S_IMODE(os.stat(os.path.join(out, "hf_model", name)).st_mode) == 0o666 & ~umask, name
    assert list(losses(out)) == list(range(1, STEPS + 1))
    assert summary["final_loss"] == losses(out)[STEPS]


def test_resume_reproduces_the_uninterrupted_losses(straight_run, tmp_path):
    """Resume from the step-3 checkpoint: steps 4-6 match the straight run within 1e-6."""
    cfg, _ = straight_run
    resumed_dir = tmp_path / "resumed"
    os.makedirs(resumed_dir / "checkpoints")
    shutil.copytree(os.path.join(cfg.output_dir, "checkpoints", "step_000003"),
                    resumed_dir / "checkpoints" / "step_000003")
    from dataclasses import replace

    run_lm_training(replace(cfg, output_dir=str(resumed_dir), tracking=replace(cfg.tracking, backends=["jsonl"])),
                    "sft")
    expected, got = losses(cfg.output_dir), losses(str(resumed_dir))
    assert list(got) == [4, 5, 6]
    for step in got:
        assert got[step] == pytest.approx(expected[step], abs=1e-6), step
    assert got[4] != pytest.approx(expected[1], abs=1e-3)  # it resumed, it did not restart


def test_the_export_command_writes_a_checkpoint_as_the_run_exports_it(straight_run, tmp_path):
    """`rlsys.run export --checkpoint RUN/checkpoints/step_6` (the stage's last step) gives the run's
    own export tensor for tensor: the ranks it builds start from model.path's weights, so only the
    checkpoint read back gives them. (The command takes any layout alike: checked once, on two
    pipeline stages' shards.)"""
    import torch

    from rlsys.stages.export import run_export

    cfg, summary = straight_run
    if cfg.parallel.pp != 2:
        pytest.skip("run once, on the pipeline stages' shards")

    checkpoints = os.path.join(cfg.output_dir, "checkpoints")
    last = run_export(os.path.join(checkpoints, "step_000006"), str(tmp_path / "step6"))
    assert last["step"] == 6 and last["stage"] == "sft"
    exported, own = weights(last["hf_model"]), weights(summary["hf_model"])
    assert exported.keys() == own.keys() and all(torch.equal(exported[k], own[k]) for k in own)


def weights(model_dir: str) -> dict:
    """Every tensor of a sharded Hugging Face directory, by name."""
    from safetensors.torch import load_file

    index = json.load(open(os.path.join(model_dir, "model.safetensors.index.json")))["weight_map"]
    shards = [load_file(os.path.join(model_dir, shard)) for shard in sorted(set(index.values()))]
    return {name: tensor for shard in shards for name, tensor in shard.items()}


def test_a_mid_run_step_exports_in_bf16_that_transformers_and_vllm_read_alike(straight_run, tmp_path):
    """`export --checkpoint RUN/checkpoints/step_3 --dtype bfloat16`: step 3's weights as the checkpoint
    holds them (read here in one process), rounded to bf16, and a config that says bf16. transformers
    and vLLM, each computing in bf16, then pick the exact model's greedy token (the same bf16 weights
    computed in fp32) wherever its lead over the runner-up is more than twice the larger of their own
    distances from the exact log-probs: their rounding, measured here, is the tolerance."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    from rlsys.config.rollout import RolloutConfig
    from rlsys.rollout.vllm_engine import create_llm
    from rlsys.stages.export import run_export

    cfg, summary = straight_run
    if cfg.parallel.pp != 2:
        pytest.skip("run once, on the pipeline stages' shards")
    step3 = os.path.join(cfg.output_dir, "checkpoints", "step_000003")
    result = run_export(step3, str(tmp_path / "step3"), dtype="bfloat16")
    assert result["step"] == 3
    dcp_to_torch_save(os.path.join(step3, "model_optim"), tmp_path / "step3.pt")
    held = torch.load(tmp_path / "step3.pt", weights_only=False)["model"]
    exported, last = weights(result["hf_model"]), weights(summary["hf_model"])
    assert exported.keys() == last.keys() and exported.keys() <= held.keys()
    for name, tensor in exported.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, held[name].to(torch.bfloat16)), name
    assert any(not torch.equal(exported[name], last[name].to(torch.bfloat16)) for name in last)  # not step 6
    assert json.load(open(os.path.join(result["hf_model"], "config.json")))["dtype"] == "bfloat16"

    hf_dir = result["hf_model"]
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    prompts = ["<|user|>12+7=<|end|><|assistant|>", "<|user|>3-15=<|end|><|assistant|>",
               "<|user|>40+2=<|end|><|assistant|>", "<|user|>9-9=<|end|><|assistant|>"]
    llm = create_llm(hf_dir, RolloutConfig(engine_memory_gib=0.25, dtype="bfloat16"), seed=0)
    generated = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True),
                             use_tqdm=False)
    exact = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    in_bf16 = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16)
    assert next(in_bf16.parameters()).dtype == torch.bfloat16
    rows = []  # per generated position: exact log-probs, transformers' bf16 ones, vLLM's token and its log-prob
    for prompt, output in zip(prompts, generated):
        prompt_ids = tokenizer(prompt)["input_ids"]
        tokens = list(output.outputs[0].token_ids)
        ids = torch.tensor([prompt_ids + tokens])
        with torch.no_grad():
            exact_lp = torch.log_softmax(exact(ids).logits[0].float(), -1)
            bf16_lp = torch.log_softmax(in_bf16(ids).logits[0].float(), -1)
        for i, (token, logprobs) in enumerate(zip(tokens, output.outputs[0].logprobs)):
            at = len(prompt_ids) - 1 + i
            rows.append((exact_lp[at], bf16_lp[at], token, logprobs[token].logprob))
    hf_error = max(float((bf16 - ex).abs().max()) for ex, bf16, _, _ in rows)
    vllm_error = max(abs(lp - float(ex[token])) for ex, _, token, lp in rows)
    tolerance = 2 * max(hf_error, vllm_error)
    assert 0 < tolerance < 0.1, (hf_error, vllm_error)  # bf16 rounding of a small model, not a misread weight
    decided = 0
    for ex, bf16, token, _ in rows:
        top2 = ex.topk(2)
        if float(top2.values[0] - top2.values[1]) > tolerance:
            decided += 1
            assert token == int(top2.indices[0]) == int(bf16.argmax()), (token, top2, hf_error, vllm_error)
    assert decided >= len(rows) // 2, (decided, len(rows), tolerance)


def test_export_loads_in_transformers_and_vllm_and_generates(straight_run):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    from rlsys.config.rollout import RolloutConfig
    from rlsys.rollout.vllm_engine import create_llm

    hf_dir = os.path.join(straight_run[0].output_dir, "hf_model")
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    prompts = ["<|user|>12+7=<|end|><|assistant|>", "<|user|>3-15=<|end|><|assistant|>"]
    expected = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=6, do_sample=False)
        expected.append(out[0, ids["input_ids"].shape[1]:].tolist())

    llm = create_llm(hf_dir, RolloutConfig(engine_memory_gib=0.25), seed=0)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outputs]
    assert got == expected
    assert all(len(tokens) > 0 for tokens in got)
    # the HF shapes, whatever the layout split (tp=2 splits the 105-token vocabulary 53 + 52)
    original = AutoModelForCausalLM.from_pretrained(straight_run[0].model.path)
    assert {n: p.shape for n, p in model.named_parameters()} == {n: p.shape for n, p in original.named_parameters()}
    assert stored_names(hf_dir) == stored_names(straight_run[0].model.path)  # an MoE's experts: one tensor each


def stored_names(model_dir: str) -> set[str]:
    from safetensors import safe_open

    names = set()
    for path in glob.glob(os.path.join(model_dir, "*.safetensors")):
        with safe_open(path, framework="pt") as f:
            names.update(f.keys())
    return names


def test_tensorboard_has_the_jsonl_metric_names(straight_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = straight_run[0].output_dir
    events = EventAccumulator(os.path.join(out, "tensorboard"))
    events.Reload()
    with open(os.path.join(out, "metrics.jsonl")) as f:
        names = set(json.loads(f.readline())) - {"step"}
    assert names == set(events.Tags()["scalars"])


def test_eval_stage_scores_every_prompt(ray_cluster, tiny_model_dir, arith_files, tmp_path):
    """Once, not per layout: the exports' loading is checked above."""
    import yaml

    from rlsys.run import main

    config = tmp_path / "eval.yaml"
    config.write_text(yaml.safe_dump({
        "output_dir": str(tmp_path / "eval"),
        "model": {"path": tiny_model_dir},
        "eval": {"files": [arith_files["test"]], "reward": "arith", "max_new_tokens": 4, "limit": 12},
    }))
    assert main(["eval", "--config", str(config)]) == 0
    with open(tmp_path / "eval" / "eval_results.jsonl") as f:
        rows = [json.loads(line) for line in f]
    with open(tmp_path / "eval" / "eval_summary.json") as f:
        summary = json.load(f)
    assert len(rows) == summary["num_prompts"] == 12
    assert summary["accuracy"] == sum(r["score"] for r in rows) / 12
    assert all(r["score"] == float(r["response"].strip() == r["ground_truth"]) for r in rows)


@pytest.mark.quick
def test_resources_the_cluster_lacks_are_a_config_error(ray_cluster, sft_config):
    from rlsys.config.loader import ConfigError

    with pytest.raises(ConfigError, match=r"^ray\.cpus_per_worker: 2 workers x 64 CPUs = 128 CPUs, "
                                          r"but the Ray cluster has \d+; set ray\.num_cpus=128 "):
        run_lm_training(sft_config("ray.cpus_per_worker=64"), "sft")


@pytest.mark.quick
def test_a_resumed_run_follows_its_own_schedule():
    """Resumed with more steps, the next step takes the new schedule's lr at the restored step, not
    the saved run's; resumed unchanged, exactly the lr the uninterrupted run had."""
    import torch

    from rlsys.trainer.schedule import follow_schedule, lr_multiplier

    def scheduler(total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=3e-3)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, 2, total_steps, 0.1))

    saved = scheduler(10)
    for _ in range(10):
        saved.optimizer.step()
        saved.step()
    for total_steps in (10, 15):
        resumed = scheduler(total_steps)
        resumed.optimizer.load_state_dict(saved.optimizer.state_dict())
        resumed.load_state_dict(saved.state_dict())
        follow_schedule(resumed, 3e-3)
        expected = saved.optimizer.param_groups[0]["lr"] if total_steps == 10 else 3e-3 * lr_multiplier(10, 2, 15, 0.1)
        assert resumed.optimizer.param_groups[0]["lr"] == expected == resumed.get_last_lr()[0]
    assert expected > 2 * saved.optimizer.param_groups[0]["lr"]  # the saved run had decayed to its floor
