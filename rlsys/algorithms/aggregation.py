"""How per-token terms become a mini-batch's loss and metrics.

Token tensors are [B, T] aligned with the targets; `mask` is 1 on response (sampled)
tokens. Aggregations divide by global counts (all ranks, all micro-batches of the
mini-batch), so summing the per-micro-batch losses gives the loss of the whole
mini-batch in any parallel layout, as in the SFT loss. Padding never reaches a loss:
masked sums select (`torch.where`) instead of multiplying, so a NaN or inf outside the
mask stays out.
"""

from __future__ import annotations

import torch


def masked(values: torch.Tensor, mask: torch.Tensor, elsewhere: torch.Tensor | float = 0.0) -> torch.Tensor:
    """`values` on the mask, `elsewhere` outside it, whatever (NaN, inf) `values` hold there."""
    return torch.where(mask.bool(), values, elsewhere)


def token_share(values: torch.Tensor, mask: torch.Tensor, counts: dict[str, int]) -> torch.Tensor:
    """This micro-batch's share of the mini-batch's mean of `values` over response tokens
    (a metric: the shares of every micro-batch and rank add up to the mean)."""
    return masked(values, mask).sum() / counts["tokens"]


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, counts: dict[str, int]) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss. `counts`: the mini-batch's global
    response "tokens" and "sequences", and the "horizon" (generation budget per response).

    token-mean: every response token weighs the same.
    seq-mean-token-mean: each response's token mean, averaged over responses.
    seq-mean-token-sum: each response's token sum, averaged over responses.
    seq-mean-token-sum-norm: each response's token sum over the horizon, averaged over
    responses (Dr. GRPO's constant normaliser; VeRL divides by the padded response length).
    """
    values = masked(per_token, mask)
    if mode == "token-mean":
        return values.sum() / counts["tokens"]
    if mode == "seq-mean-token-mean":
        return (values.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / counts["sequences"]
    if mode == "seq-mean-token-sum":
        return values.sum() / counts["sequences"]
    if mode == "seq-mean-token-sum-norm":
        return values.sum() / (counts["sequences"] * counts["horizon"])
    raise ValueError(f"unknown loss aggregation {mode!r}")


def aggregates_per_sequence(mode: str) -> bool:
    """Whether `aggregate` in this mode reads each row as one sequence (a per-row mean), which
    packing several sequences into a row would break."""
    return mode == "seq-mean-token-mean"
