"""Per-token policy-gradient terms and their aggregation.

Token tensors are [B, T] aligned with input_ids; `mask` is 1 on response
tokens. Aggregations divide by global counts (all ranks, all micro-batches of
the mini-batch) so that summing the per-micro-batch losses gives the loss of
the whole mini-batch, as in the SFT loss.
"""

from __future__ import annotations

import torch


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate max(-A r, -A clip(r, 1-low, 1+high)) and where the clip is active."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy.

    k1 = log(p/q); k2 = log(p/q)^2 / 2; k3 = q/p - 1 - log(q/p) (non-negative, unbiased).
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, global_tokens: int,
              global_sequences: int) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss.

    token-mean: every response token weighs the same.
    seq-mean-token-mean: each response's token mean, averaged over responses.
    seq-mean-token-sum: each response's token sum, averaged over responses.
    """
    masked = per_token * mask
    if mode == "token-mean":
        return masked.sum() / global_tokens
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / global_sequences
    if mode == "seq-mean-token-sum":
        return masked.sum(-1).sum() / global_sequences
    raise ValueError(f"unknown loss aggregation {mode!r}")


def entropy_from_logits(logits: torch.Tensor, rows_per_chunk: int = 2) -> torch.Tensor:
    """Per-token entropy [B, T], a few rows at a time: the softmax temporaries are
    [rows, T, vocab] each, which for a 150k vocabulary outweigh the model's activations."""
    return torch.cat([_entropy(chunk) for chunk in logits.split(rows_per_chunk)])


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return -(logprobs.exp() * logprobs).sum(-1)
