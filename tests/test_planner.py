"""The layout planner: its per-rank bytes against what each rank of a real step holds (gloo
process groups, a rank's model), its step peak against the measured one at Qwen2.5-0.5B's widths,
and the `plan` command's table, recommendation and refusals."""

from __future__ import annotations

import pytest
import torch
import transformers

from rlsys.planner.check import check
from rlsys.planner.estimate import Precision, Workload, layout_of, micro_batches, rank_memory, spans_nodes
from rlsys.planner.measure import StepShape, measure
from rlsys.planner.shards import ModelShapes, chunk
from rlsys.run import main

# One xdist worker runs this module (scripts/test.sh): its long measured steps start among the first.
pytestmark = pytest.mark.xdist_group("planner")

CPU = Precision(compute_bytes=4, mixed=False)  # steps on CPU compute in fp32
STEP = StepShape(rows=2, seq_len=32, steps=2)


@pytest.mark.quick
def test_chunk_is_torch_chunk():
    for size in range(0, 23):
        for parts in range(1, 7):
            pieces = [len(p) for p in torch.arange(size).chunk(parts)]
            pieces += [0] * (parts - len(pieces))
            assert [chunk(size, parts, i) for i in range(parts)] == pieces


def estimated_bytes(model_dir: str, layout: dict, step: StepShape) -> list[tuple[int, int, int]]:
    shapes = ModelShapes(transformers.AutoConfig.from_pretrained(model_dir))
    plan = layout_of(**layout)
    work = Workload(sequences=step.rows * plan.dims.dp_size, seq_len=step.seq_len, micro_batch_rows=step.rows)
    memory = [rank_memory(shapes, plan, work, CPU, rank) for rank in range(plan.dims.world_size)]
    return [(m.params, m.grads, m.optim) for m in memory]


@pytest.mark.quick
@pytest.mark.parametrize("layout", [{"dp_shard": 2}, {"tp": 2}, {"pp": 2}, {"cp": 2}, {"dp_replicate": 2},
                                    {"dp_shard": 2, "tp": 2}],
                         ids=lambda layout: ",".join(f"{k}={v}" for k, v in layout.items()))
def test_rank_bytes_equal_measured_dense(tiny_model_dir, layout):
    measured = [(row["params"], row["grads"], row["optim"]) for row in measure(layout, tiny_model_dir, STEP)]
    assert estimated_bytes(tiny_model_dir, layout, STEP) == measured


@pytest.mark.quick
def test_lora_rank_bytes_equal_measured(tiny_model_dir):
    """With LoRA only the adapters have gradients and AdamW state; the parameters are the base's and theirs."""
    from dataclasses import replace

    step = replace(STEP, lora_rank=4)
    [measured] = measure({"dp_shard": 1}, tiny_model_dir, step)
    shapes = ModelShapes(transformers.AutoConfig.from_pretrained(tiny_model_dir))
    work = Workload(sequences=step.rows, seq_len=step.seq_len, micro_batch_rows=step.rows, lora_rank=4)
    estimate = rank_memory(shapes, layout_of(dp_shard=1), work, CPU, 0)
    assert (estimate.params, estimate.grads, estimate.optim) == \
        (measured["params"], measured["grads"], measured["optim"])


def test_one_rank_in_a_fake_group_holds_what_a_real_rank_holds(tiny_model_dir):
    """`StepShape.one_rank` (rank 0 alone, its peers a fake process group, random weights) holds the
    bytes rank 0 of the real layout holds."""
    from dataclasses import replace

    layout = {"dp_shard": 2, "tp": 2}
    real = measure(layout, tiny_model_dir, STEP)[0]
    [alone] = measure(layout, tiny_model_dir, replace(STEP, one_rank=True))
    assert [alone[k] for k in ("params", "grads", "optim")] == [real[k] for k in ("params", "grads", "optim")]


@pytest.mark.parametrize("layout", [{"dp_shard": 2, "ep": 2}, {"tp": 2, "ep": 2}, {"dp_shard": 2},
                                    {"dp_shard": 2, "tp": 2, "ep": 2}],
                         ids=lambda layout: ",".join(f"{k}={v}" for k, v in layout.items()))
def test_rank_bytes_equal_measured_moe(moe_model_dirs, layout):
    model_dir = moe_model_dirs["qwen3_moe"]
    measured = [(row["params"], row["grads"], row["optim"]) for row in measure(layout, model_dir, STEP)]
    assert estimated_bytes(model_dir, layout, STEP) == measured


QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=512)


def test_step_peak_within_15_percent_at_05b_widths(tmp_path):
    """Two layouts of a model of Qwen2.5-0.5B's widths and vocabulary with 6 of its 24 blocks (the
    whole model, and more layouts: benchmarks/plan_full_size.py): the estimated peak of a training
    step (states, FSDP's gathered weights, activations) against the measured one, with activation
    checkpointing on one rank and without it on two FSDP2 ranks."""
    from rlsys.models.tiny import TinyModelSpec, write_tiny_model

    model_dir = write_tiny_model(str(tmp_path / "m"), TinyModelSpec(**{**QWEN25_05B, "num_hidden_layers": 6}))
    shapes = ModelShapes(transformers.AutoConfig.from_pretrained(model_dir))
    step = StepShape(rows=2, seq_len=256, steps=2)
    ratios, beyond_states = {}, {}
    for layout in ({"dp_shard": 1, "activation_checkpointing": True}, {"dp_shard": 2}):
        plan = layout_of(**layout)
        work = Workload(sequences=step.rows * plan.dims.dp_size, seq_len=step.seq_len, micro_batch_rows=step.rows)
        measured = measure(layout, model_dir, step)
        for rank, row in enumerate(measured):
            estimate = rank_memory(shapes, plan, work, CPU, rank)
            ratios[f"{plan.name} rank {rank}"] = estimate.update_peak / row["step_peak"]
            held = row["params"] + row["grads"] + row["optim"]
            beyond = estimate.update_peak - estimate.states
            beyond_states[f"{plan.name} rank {rank}"] = beyond / (row["step_peak"] - held)
    print("step peak, estimated / measured:", ratios, "\nbeyond the states:", beyond_states)
    assert all(0.85 <= ratio <= 1.15 for ratio in ratios.values()), ratios
    # the activations and gathered weights, apart from the states that dominate the peak
    assert all(0.8 <= ratio <= 1.2 for ratio in beyond_states.values()), beyond_states


def test_check_sets_estimate_beside_measurement():
    config = transformers.AutoConfig.from_pretrained("examples/plan/qwen2.5-32b")
    rows = check(config, layout_of(pp=4, dp_shard=8, tp=8, pp_microbatches=8))
    assert [row["layout"] for row in rows] == ["pp2 tp2"] * 4  # at most 4 ranks here, tp first
    for row in rows:
        est, got = row["estimate"], row["measured"]
        assert (est.params, est.grads, est.optim) == (got["params"], got["grads"], got["optim"])


def plan_output(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["plan", "--config", "examples/plan/rlvr.yaml", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.quick
def test_plan_recommends_a_layout_the_job_runs(capsys):
    """The recommendation's overrides pass the job's own preflight and give a layout of every GPU."""
    from rlsys.config.schema import RLJobConfig
    from rlsys.models.directory import read_model_config
    from rlsys.parallel.parallelize import check_layout
    from rlsys.planner.job import load_job
    from rlsys.rl.update import check_update_batches

    model = "model.path=examples/plan/qwen2.5-32b"
    code, out, _ = plan_output(capsys, "--gpus", "64", "--gpu-memory", "80", model, "train.prompts_per_step=24")
    assert code == 0
    first_row = next(line for line in out.splitlines() if line.startswith("| ") and "layout" not in line)
    assert float(first_row.split("|")[3]) <= 72  # 80 GiB less the 10% headroom
    overrides = next(line for line in out.splitlines() if "overrides:" in line).split("overrides:")[1].split()
    cfg = load_job("examples/plan/rlvr.yaml", [model, "train.prompts_per_step=24", *overrides])
    assert isinstance(cfg, RLJobConfig)
    dims = check_layout(cfg.parallel, read_model_config(cfg.model.path, "model.path"))
    check_update_batches(cfg, dims.dp_size)  # 24 x 8 responses: a data-parallel size of 64 would not divide them
    assert dims.world_size == 64


@pytest.mark.quick
def test_plan_says_when_nothing_fits(capsys):
    code, out, _ = plan_output(capsys, "--gpus", "2", "--gpu-memory", "24", "model.path=examples/plan/qwen2.5-32b")
    assert code == 0 and "no layout fits 21.6 GiB" in out  # 24 GiB less the 10% headroom


@pytest.mark.quick
def test_plan_bad_input_is_one_line(capsys, tmp_path):
    code, _, err = plan_output(capsys, "--gpus", "0", "--gpu-memory", "80")
    assert code == 2 and err.strip() == "rlsys plan: error: --gpus: must be > 0, got 0"
    code, _, err = plan_output(capsys, "--gpus", "8", "--gpu-memory", "80", f"model.path={tmp_path}")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "model.path: not a Hugging Face model directory" in err


@pytest.mark.quick
def test_micro_batches_follow_the_engine():
    """A token budget is per rank: under cp a micro-batch holds cp times as many tokens of whole
    sequences (`RankModel._token_budget_sizes`); a pipeline runs pp_microbatches of them."""
    work = Workload(sequences=64, seq_len=1000, micro_batch_rows=4, micro_batch_tokens=4000)
    assert micro_batches(layout_of(dp_shard=2), work) == (8, 4000)  # 32 rows a rank, 4 a micro-batch
    assert micro_batches(layout_of(dp_shard=2, cp=2), work) == (4, 4000)  # 8 rows, split over 2 ranks
    rows = Workload(sequences=64, seq_len=1000, micro_batch_rows=4)
    assert micro_batches(layout_of(dp_shard=2, cp=2), rows) == (8, 2000)
    assert micro_batches(layout_of(pp=2, dp_shard=2, pp_microbatches=8), rows) == (8, 4000)


@pytest.mark.quick
def test_groups_within_and_across_nodes():
    assert not spans_nodes(1, 8, 8) and spans_nodes(1, 16, 8)
    assert not spans_nodes(2, 4, 8) and spans_nodes(8, 2, 8)  # tp=2 x 4 peers; pp stages a node apart
    assert spans_nodes(1, 4, 6)  # 4-rank groups on 6-GPU nodes: the second group straddles two nodes
    assert not spans_nodes(1, 1, 8)


@pytest.mark.quick
def test_plan_offloads_a_job_whose_states_do_not_fit_and_says_what_it_costs(capsys):
    """Qwen2.5-32B GRPO on 8 x 80 GB: no layout holds the states on the GPUs, so the planner
    keeps them in host memory, says what that costs a step, and refuses when the host is too small."""
    model = "model.path=examples/plan/qwen2.5-32b"
    code, out, _ = plan_output(capsys, "--gpus", "8", "--gpu-memory", "80", "--prompt-tokens", "1024", model)
    recommended = next(line for line in out.splitlines() if line.startswith("recommended:"))
    assert code == 0 and "+offload" in recommended and "AdamW on the host adds" in recommended
    assert "parallel.offload=true" in out
    code, out, _ = plan_output(capsys, "--gpus", "8", "--gpu-memory", "80", "--prompt-tokens", "1024", model,
                               "--host-memory", "256")
    assert code == 0 and "no layout fits 72.0 GiB a GPU and 192 GiB of host memory a node" in out
