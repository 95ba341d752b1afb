"""The metrics of an RL step that describe its samples: lengths and throughput, agent turns and
tool use, and the engine/trainer mismatch."""

from __future__ import annotations

import torch

from rlsys.agents.trajectory import Trajectory
from rlsys.algorithms.rollout_correction import mismatch_metrics
from rlsys.config.loader import ConfigError
from rlsys.data.batching import Batch


def sample_metrics(samples: list[Trajectory], batch: Batch, times: dict[str, float]) -> dict[str, float]:
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
    return {
        "response/length_mean": lengths.mean().item(),
        "response/length_max": lengths.max().item(),
        "response/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
        "throughput/generated_tokens_per_s": lengths.sum().item() / times["time/generate_s"],
        "throughput/tokens": float(batch["attention_mask"].sum()),
        "throughput/tokens_per_s": float(batch["attention_mask"].sum()) / times["time/step_s"],
    }


def agent_metrics(trajectories: list[Trajectory], rows: list[Trajectory]) -> dict[str, float]:
    """Turns and tool use of a step's episodes (`trajectories`), the segments of theirs trained on
    (`rows`) and their response tokens, and the share of those masked out of the loss."""
    count = len(trajectories)
    response = sum(len(t.response_ids) for t in rows)
    return {
        "agent/segments_mean": len(rows) / count,
        "agent/segment_tokens_mean": response / len(rows),
        "agent/turns_mean": sum(t.num_turns for t in trajectories) / count,
        "agent/tool_calls_mean": sum(t.tool_calls for t in trajectories) / count,
        "agent/tool_errors": float(sum(t.tool_errors for t in trajectories)),
        "agent/tool_s_mean": sum(t.tool_seconds for t in trajectories) / count,
        "agent/masked_token_share": 1 - sum(t.sampled_tokens for t in rows) / max(1, response),
    }


def dropped_metrics(samples: list[Trajectory], step: int) -> dict[str, float]:
    """Samples an agent loop made no trajectory of (the `openai` loop's harness failed), by reason, and
    calls that broke a session's recorded prefix; a ConfigError when the step has nothing left to train."""
    reasons = [s.dropped for s in samples if s.dropped]
    if len(reasons) == len(samples):
        counts = ", ".join(f"{reasons.count(r)} {r}" for r in sorted(set(reasons)))
        key = "rollout.max_model_len" if set(reasons) == {"rejected"} else "rollout.agent_entry"
        raise ConfigError(f"{key}: at step {step} no sample made a trajectory ({counts}); the reasons are in the "
                          f"rollout engines' log")
    metrics = {f"agent/dropped_{reason}": float(reasons.count(reason))
               for reason in ("error", "timeout", "no_call", "rejected")}
    return {**metrics, "agent/prefix_breaks": float(sum(s.prefix_breaks for s in samples))}


def mismatch(trainer: torch.Tensor | None, engine: torch.Tensor, batch: Batch) -> dict[str, float]:
    """The engine/trainer mismatch (`rollout_correction.mismatch_metrics`) over the response tokens
    of the rows the trainer's log-probs cover (the first rows of the batch), both of the sampling
    policy (none while a critic warms up without a trainer pass)."""
    if trainer is None:
        return {}
    mask = batch["loss_mask"][:len(trainer)].bool()
    return mismatch_metrics(trainer[mask], engine[:int(mask.sum())], mask.sum(-1).tolist())


def async_metrics(samples: list[Trajectory], step: int, stream, max_staleness: int) -> dict[str, float]:
    """How stale the trained tokens are (policy versions behind the one updated): mean, max and each
    share; and the groups the stream (`RolloutStream`) dropped for staleness, and generated again
    after their engine died, so far."""
    staleness = torch.tensor([step - 1 - v for t in samples for v in t.versions], dtype=torch.float32)
    metrics = {"async/staleness_mean": staleness.mean().item(), "async/staleness_max": staleness.max().item(),
               "async/dropped_groups": float(stream.dropped), "async/regenerated_groups": float(stream.regenerated)}
    for lag in range(max_staleness + 1):
        metrics[f"async/staleness_{lag}_share"] = (staleness == lag).float().mean().item()
    return metrics
