"""The engine/trainer mismatch: how large it is, and the corrections against it.

The engine samples with its own kernels, so its probability of a token is not exactly the
trainer's, even with the same weights (bf16, fused kernels, another batch shape; under async RL
an older policy too). Every correction reads the ratio pi_old / pi_rollout of each response
token, the trainer's old log-prob against the engine's (VeRL's `rollout_correction`):

- truncated importance sampling (TIS): each token's policy-gradient loss weighted by
  min(ratio, threshold), or every token of a response by min(product of its ratios, threshold);
- rejection: tokens (token) or whole responses (sequence: the product of their ratios;
  geometric: their geometric mean) whose ratio lies outside [lower, upper] are dropped;
  token-level with both bounds is IcePop's two-sided mask;
- a veto: a response holding one token whose ratio is below a threshold is dropped whole.

A dropped token's loss is multiplied by 0; the loss keeps its normaliser (global token counts).
Log-ratios are clamped to +-20 before they are exponentiated.
"""

from __future__ import annotations

import math

import torch

from rlsys.algorithms.aggregation import masked
from rlsys.config.rl import RolloutCorrectionConfig

SAFE_LOG_RATIO = 20.0


def correction_factors(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                       cfg: RolloutCorrectionConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """[B, T] factors for each token's policy-gradient loss (no gradient): importance weights
    times 0 where a rejection or the veto drops the token; and [B, T] values whose mean over the
    response tokens is a metric (the weights, where truncation acted, where a token was dropped).
    Padding (NaN included) gets factor 1."""
    log_ratio = masked(old_logprobs.detach() - rollout_logprobs, mask)
    factors, metrics = torch.ones_like(log_ratio), {}
    if cfg.rollout_is != "none":
        factors, truncated = truncated_is_weights(log_ratio, mask, cfg.rollout_is, cfg.rollout_is_threshold)
        metrics.update({"rollout_corr/is_weight": factors, "rollout_corr/truncated_frac": truncated})
    keep = torch.ones_like(log_ratio)
    if cfg.rollout_rs != "none":
        lower = cfg.rollout_rs_threshold_lower or 1 / cfg.rollout_rs_threshold
        keep = keep * rejection_keep(log_ratio, mask, cfg.rollout_rs, lower, cfg.rollout_rs_threshold)
    if cfg.rollout_token_veto_threshold is not None:
        keep = keep * veto_keep(log_ratio, mask, cfg.rollout_token_veto_threshold)
    if cfg.rollout_rs != "none" or cfg.rollout_token_veto_threshold is not None:
        metrics["rollout_corr/rejected_frac"] = 1 - keep
    return factors * keep, metrics


def truncated_is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str,
                         threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] min(ratio, threshold) per token, or per response of its product of ratios, and
    where the truncation acted. `log_ratio` is 0 outside the mask."""
    if level == "sequence":
        log_ratio = _per_response(log_ratio.sum(-1), log_ratio)
    limit = math.log(threshold)
    return log_ratio.clamp(max=limit).exp(), (log_ratio > limit).float()


def rejection_keep(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, lower: float,
                   upper: float) -> torch.Tensor:
    """[B, T] 1 where the token's ratio (token), its response's product of ratios (sequence) or
    their geometric mean (geometric) lies within [lower, upper], else 0; 1 on padding."""
    if level == "sequence":
        log_ratio = _per_response(log_ratio.sum(-1), log_ratio)
    elif level == "geometric":
        log_ratio = _per_response(log_ratio.sum(-1) / mask.sum(-1).clamp(min=1), log_ratio)
    inside = (log_ratio >= math.log(lower)) & (log_ratio <= math.log(upper))
    return torch.where(mask.bool(), inside.float(), 1.0)


def veto_keep(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """[B, T] 0 on every token of a response holding a token whose ratio is below `threshold`;
    1 on padding."""
    vetoed = masked(log_ratio < math.log(threshold), mask, False).any(-1, keepdim=True)
    return torch.where(mask.bool(), (~vetoed).float(), 1.0)


def _per_response(per_row: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return per_row.clamp(-SAFE_LOG_RATIO, SAFE_LOG_RATIO).unsqueeze(-1).expand_as(like)


def mismatch_metrics(trainer: torch.Tensor, engine: torch.Tensor) -> dict[str, float]:
    """How far apart the engine's and the trainer's log-probs of the same sampled tokens are, over
    1-D tensors of response tokens, both of the sampling policy: mean |difference|; the KL from the
    engine's policy to the trainer's, estimated from the engine's samples with k1 (its mean
    log-ratio) and k3 ((r - 1) - log r, r = pi_trainer / pi_engine, never negative); quantiles and
    maximum of |log r|; the share of tokens whose ratio lies outside [1/2, 2] (which a threshold of 2
    truncates or rejects)."""
    if trainer.numel() == 0:
        return {}
    log_ratio = (trainer - engine).double()
    size = log_ratio.abs()
    p50, p90, p99 = torch.quantile(size, torch.tensor([0.5, 0.9, 0.99], dtype=size.dtype)).tolist()
    return {
        "rollout/logprob_abs_diff": size.mean().item(),
        "mismatch/kl_k1": (-log_ratio).mean().item(),
        "mismatch/kl_k3": (log_ratio.clamp(max=SAFE_LOG_RATIO).exp() - 1 - log_ratio).mean().item(),
        "mismatch/abs_log_ratio_p50": p50,
        "mismatch/abs_log_ratio_p90": p90,
        "mismatch/abs_log_ratio_p99": p99,
        "mismatch/abs_log_ratio_max": size.max().item(),
        "mismatch/ratio_outside_2x_frac": (size > math.log(2)).double().mean().item(),
    }
