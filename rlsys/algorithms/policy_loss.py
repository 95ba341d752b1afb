"""Per-token policy-gradient losses, chosen by name (`algorithm.policy_loss`), KL
estimators and the aggregation of per-token terms, with VeRL's semantics.

Token tensors are [B, T] aligned with the targets; `mask` is 1 on response
tokens. Aggregations divide by global counts (all ranks, all micro-batches of
the mini-batch) so that summing the per-micro-batch losses gives the loss of
the whole mini-batch, as in the SFT loss. Padding never reaches a loss: masked
sums select (`torch.where`) instead of multiplying, so a NaN or inf outside the
mask stays out.

A user's own loss registers with `@register_policy_loss("name")` in a file listed
under `algorithm.extensions`: `fn(logprobs, old_logprobs, advantages, mask, algo)
-> PolicyLossTerms`; `token_level=True` declares that each token's loss reads only that
token's values, which lets the engine pack sequences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlsys.config.schema import AlgorithmConfig
from rlsys.registry import Registry

LOG_RATIO_LIMIT = 20.0
"""VeRL clamps log-ratios to +-20 before `exp`."""


@dataclass(frozen=True)
class PolicyLossTerms:
    per_token: torch.Tensor
    """[B, T] loss per token."""
    clipped: torch.Tensor
    """[B, T] 1 where the ratio clip is active."""
    clipped_lower: torch.Tensor | None = None
    """[B, T] 1 where the dual clip bounds a negative advantage's loss."""


PolicyLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AlgorithmConfig], PolicyLossTerms]


@dataclass(frozen=True)
class PolicyLoss:
    fn: PolicyLossFn
    loss_agg: str | None = None
    """An aggregation the loss is defined with (GSPO's sequence mean), else `algorithm.loss_agg`."""
    token_level: bool = False
    """Each token's loss depends on that token alone (not on its row: a sequence's mean), so the
    engine may pack several sequences into a row (`rlsys.data.packing`)."""


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def register_policy_loss(name: str, loss_agg: str | None = None, token_level: bool = False
                         ) -> Callable[[PolicyLossFn], PolicyLossFn]:
    def add(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES.register(name, PolicyLoss(fn, loss_agg, token_level))
        return fn

    return add


@register_policy_loss("vanilla", token_level=True)
def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, algo: AlgorithmConfig) -> PolicyLossTerms:
    """PPO's clipped surrogate max(-A r, -A clip(r, 1 - low, 1 + high)), with VeRL's dual clip:
    a negative advantage's loss is at most -A x clip_ratio_c."""
    ratio = torch.exp((logprobs - old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - algo.clip_ratio_low, 1 + algo.clip_ratio_high)
    surrogate = torch.maximum(unclipped, clipped)
    bound = -advantages * algo.clip_ratio_c
    negative = advantages < 0
    per_token = torch.where(negative, torch.minimum(surrogate, bound), surrogate)
    return PolicyLossTerms(per_token, (clipped > unclipped).float(), ((surrogate > bound) & negative).float())


@register_policy_loss("gspo", loss_agg="seq-mean-token-mean")
def gspo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, algo: AlgorithmConfig) -> PolicyLossTerms:
    """GSPO: one importance ratio per sequence, exp of the mean token log-ratio, clipped as in
    PPO; each token carries it with its own gradient (log p - sg(log p) + sg(mean log-ratio)),
    the log clamped at 10, averaged per sequence, as in VeRL."""
    log_ratio = masked(logprobs - old_logprobs, mask)
    sequence_log_ratio = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    ratio = torch.exp((logprobs - logprobs.detach() + sequence_log_ratio.detach()).clamp(max=10.0))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - algo.clip_ratio_low, 1 + algo.clip_ratio_high)
    return PolicyLossTerms(torch.maximum(unclipped, clipped), (clipped > unclipped).float())


KL_ESTIMATORS = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3", "abs": "abs"}
"""Accepted names (VeRL's included) -> the estimator."""


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy.

    k1 (VeRL: kl) = log(p/q); abs = |log(p/q)|; k2 (mse) = log(p/q)^2 / 2;
    k3 (low_var_kl) = q/p - 1 - log(q/p), non-negative and unbiased, with VeRL's
    clamps: log(q/p) to +-20, the estimate to [-10, 10].
    """
    log_ratio = logprobs - ref_logprobs
    kind = KL_ESTIMATORS.get(estimator)
    if kind == "k1":
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        reverse = (-log_ratio).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        return (torch.exp(reverse) - reverse - 1).clamp(-10, 10)
    raise ValueError(f"unknown KL estimator {estimator!r}")


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


def entropy_from_logits(logits: torch.Tensor, chunk_elements: int = 1 << 24) -> torch.Tensor:
    """Per-token entropy [B, T], over rows of at most `chunk_elements` logits at a time (at
    least one row): the softmax temporaries of a whole micro-batch over a 150k vocabulary
    outweigh the model's activations, while a small vocabulary is best done in one piece."""
    rows = max(1, chunk_elements // max(1, logits[0].numel()))
    return torch.cat([_entropy(chunk) for chunk in logits.split(rows)])


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return -(logprobs.exp() * logprobs).sum(-1)
