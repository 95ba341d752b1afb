"""Truncated importance sampling for the engine/trainer mismatch (TIS).

The engine samples with its own kernels, so its probability of a token is not
exactly the trainer's, even with the same weights (bf16, fused kernels, another
batch shape). The PPO ratio is taken against the trainer's old log-probs; TIS
reweights each token's policy-gradient loss by how much likelier the trainer's
old policy made the sample than the engine did, pi_old / pi_rollout, truncated
at a threshold so a rare token cannot dominate the batch. With `sequence`, one
weight per response: the product of its tokens' ratios (VeRL's
`rollout_correction`: `rollout_is` token / sequence, `rollout_is_threshold`).
"""

from __future__ import annotations

import math

import torch

from rlsys.algorithms.aggregation import masked


def truncated_is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                         level: str, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] weights min(pi_old / pi_rollout, threshold), no gradient, and where the
    truncation was active. Padding (NaN included) gets weight 1."""
    log_ratio = masked(old_logprobs.detach() - rollout_logprobs, mask)
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    limit = math.log(threshold)
    return log_ratio.clamp(max=limit).exp(), (log_ratio > limit).float()
