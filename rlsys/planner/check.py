"""`plan --check`: one training step of a layout on this machine, scaled down (at most 4 ranks,
each degree at most 2, a tiny Qwen2, or for an MoE model a tiny model of its family), with the
estimate beside what each rank held. `plan --check-full`: rank 0 of the layout at the model's
full size, alone in a fake process group (`StepShape.one_rank`), its step peak beside the estimate."""

from __future__ import annotations

import tempfile
from dataclasses import asdict, replace

import transformers

from rlsys.models.moe import num_experts
from rlsys.models.tiny import TinyModelSpec, write_tiny_model
from rlsys.planner.estimate import Layout, Precision, RankMemory, Workload, rank_memory
from rlsys.planner.measure import StepShape, measure
from rlsys.planner.shards import ModelShapes

MIB = 2**20
SCALE_ORDER = ("tp", "pp", "cp", "dp_shard", "dp_replicate")


def scaled_down(layout: Layout, max_ranks: int = 4) -> Layout:
    """The layout's parallel dimensions at degree 2, as many as `max_ranks` allows, tp first."""
    degrees, world = {}, 1
    for name in SCALE_ORDER:
        if getattr(layout.dims, name) > 1 and world * 2 <= max_ranks:
            degrees[name], world = 2, world * 2
    token_ranks = degrees.get("dp_shard", 1) * degrees.get("cp", 1) * degrees.get("tp", 1)
    ep = 2 if layout.dims.ep > 1 and token_ranks % 2 == 0 else 1
    pipeline = {"pp_microbatches": 2 * layout.stages_per_rank} if "pp" in degrees else {}
    degrees = {name: degrees.get(name, 1) for name in SCALE_ORDER}
    return Layout(replace(layout.parallel, **degrees, ep=ep, **pipeline, sequence_parallel=degrees["tp"] > 1,
                          loss_parallel=degrees["tp"] > 1))


def tiny_spec(config, layout: Layout) -> TinyModelSpec:
    """A tiny model that `layout` can split (an uneven vocabulary): Qwen2, or for an MoE model
    a model of its family."""
    experts = dict(num_experts=4, moe_type=config.model_type) if num_experts(config) else {}
    return TinyModelSpec(hidden_size=64, intermediate_size=128,
                         num_hidden_layers=max(4, 2 * layout.dims.pp * layout.stages_per_rank),
                         num_attention_heads=4, num_key_value_heads=4, vocab_size=105, **experts)


def check(config, layout: Layout, step: StepShape = StepShape(rows=2, seq_len=64, steps=2)) -> list[dict]:
    """Per rank of the scaled-down layout: the estimated and the measured bytes."""
    small = scaled_down(layout)
    with tempfile.TemporaryDirectory() as model_dir:
        write_tiny_model(model_dir, tiny_spec(config, small))
        shapes = ModelShapes(transformers.AutoConfig.from_pretrained(model_dir))
        measured = measure(asdict(small.parallel), model_dir, step)
    work = Workload(sequences=step.rows * small.dims.dp_size, seq_len=step.seq_len,
                    micro_batch_rows=step.micro_batch or step.rows)
    precision = measured_precision(step)
    rows = []
    for rank, got in enumerate(measured):
        estimate = rank_memory(shapes, small, work, precision, rank)
        rows.append({"layout": small.name, "rank": rank, "estimate": estimate, "measured": got})
    return rows


FULL_SIZE_STEP = StepShape(rows=1, seq_len=256, steps=2, one_rank=True)


def measured_precision(step: StepShape) -> Precision:
    """What a measured step computes in (`planner.measure`): fp32 on a CPU, bf16 over fp32 masters on a GPU."""
    return Precision() if step.device == "cuda" else Precision(compute_bytes=4, mixed=False)


def _full_size_memory(model_dir: str, layout: Layout, step: StepShape) -> RankMemory:
    """The estimate of rank 0 at full size, computing as the measured step does."""
    shapes = ModelShapes(transformers.AutoConfig.from_pretrained(model_dir))
    work = Workload(sequences=step.rows * layout.dims.dp_size, seq_len=step.seq_len,
                    micro_batch_rows=step.micro_batch or step.rows)
    return rank_memory(shapes, layout, work, measured_precision(step), 0)


def full_size_estimate(model_dir: str, layout: Layout, step: StepShape = FULL_SIZE_STEP) -> int:
    """Bytes rank 0 holds at its step's peak, wherever they live (states, gathered weights, activations)."""
    return _held_peak(_full_size_memory(model_dir, layout, step))


def _held_peak(estimate: RankMemory) -> int:
    return estimate.held + estimate.gathered + estimate.activations


def check_full_size(model_dir: str, layout: Layout, step: StepShape = FULL_SIZE_STEP) -> dict:
    """Rank 0 of `layout` at the size of the model in `model_dir` (a config.json is enough), measured
    on `step.device`, beside the estimate of the same rank: what it holds wherever it
    lives (states, gathered weights, activations) against the peak of what its tensors held."""
    [measured] = measure(asdict(layout.parallel), model_dir, step)
    estimate = _full_size_memory(model_dir, layout, step)
    peak = _held_peak(estimate)
    return {"layout": layout.name, "estimate": estimate, "estimated_peak": peak, "measured": measured,
            "ratio": peak / measured["step_peak"]}


def full_size_table(rows: list[dict]) -> str:
    lines = ["| layout | states MiB est / measured | step peak MiB est / measured | est / measured | step s |",
             "|---|---|---|---|---|"]
    for row in rows:
        est, got = row["estimate"], row["measured"]
        held = got["params"] + got["grads"] + got["optim"]
        lines.append(f"| {row['layout']} | {est.held / MIB:.0f} / {held / MIB:.0f} "
                     f"| {row['estimated_peak'] / MIB:.0f} / {got['step_peak'] / MIB:.0f} "
                     f"| {row['ratio']:.2f} | {got['step_s']:.0f} |")
    return "\n".join(lines)


def check_table(rows: list[dict]) -> str:
    lines = ["| layout | rank | params MiB est / measured | grads MiB | optimizer MiB | step peak MiB est / measured |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        est, got = row["estimate"], row["measured"]
        lines.append(f"| {row['layout']} | {row['rank']} | {est.params / MIB:.2f} / {got['params'] / MIB:.2f} "
                     f"| {est.grads / MIB:.2f} / {got['grads'] / MIB:.2f} | {est.optim / MIB:.2f} / "
                     f"{got['optim'] / MIB:.2f} | {est.update_peak / MIB:.0f} / {got['step_peak'] / MIB:.0f} |")
    return "\n".join(lines)
