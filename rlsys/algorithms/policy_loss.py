"""Per-token policy-gradient losses, chosen by name (`algorithm.policy_loss`), each VeRL's
function of the same name (`verl/trainer/ppo/core_algos.py`). Token tensors are [B, T] aligned
with the targets; `mask` is 1 on response tokens. How per-token terms become the loss:
`rlsys.algorithms.aggregation`; an engine/trainer correction multiplies the per-token loss
(`rlsys.algorithms.rollout_correction`).

A user's own loss registers with `@register_policy_loss("name")` in a file listed
under `algorithm.extensions`: `fn(logprobs, old_logprobs, advantages, mask, algo)
-> PolicyLossTerms`; `token_level=True` declares that each token's loss reads only that
token's values, which lets the engine pack sequences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlsys.algorithms.aggregation import masked
from rlsys.algorithms.kl import LOG_RATIO_LIMIT
from rlsys.config.rl import AlgorithmConfig
from rlsys.registry import Registry


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
    whole_sequences: bool = False
    """A token's loss reads its whole sequence or the micro-batch (a sequence's ratio, the batch's
    covariance): each sequence must be on one rank (not under context parallel)."""


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def register_policy_loss(name: str, loss_agg: str | None = None, token_level: bool = False,
                         whole_sequences: bool = False) -> Callable[[PolicyLossFn], PolicyLossFn]:
    def add(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES.register(name, PolicyLoss(fn, loss_agg, token_level, whole_sequences))
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


@register_policy_loss("gspo", loss_agg="seq-mean-token-mean", whole_sequences=True)
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


def _ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, limit: float = LOG_RATIO_LIMIT) -> torch.Tensor:
    return torch.exp((logprobs - old_logprobs).clamp(-limit, limit))


@register_policy_loss("cispo", token_level=True)
def cispo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
               mask: torch.Tensor, algo: AlgorithmConfig) -> PolicyLossTerms:
    """CISPO (MiniMax-M1): -sg(clip(r, 1 - low, 1 + high)) x A x log p. The clipped importance
    weight carries no gradient, so a clipped token still gets one (through log p)."""
    ratio = _ratio(logprobs, old_logprobs)
    weight = torch.clamp(ratio, 1 - algo.clip_ratio_low, 1 + algo.clip_ratio_high)
    return PolicyLossTerms(-weight.detach() * advantages * logprobs, (ratio != weight).float())


@register_policy_loss("sapo", loss_agg="seq-mean-token-mean", whole_sequences=True)
def sapo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, algo: AlgorithmConfig) -> PolicyLossTerms:
    """SAPO (soft adaptive policy optimisation): -A x sigmoid(tau (r - 1)) x 4 / tau, a smooth gate
    in place of the clip, tau = tau_pos where A > 0 else tau_neg; averaged per sequence."""
    ratio = _ratio(logprobs, old_logprobs)
    tau = torch.where(advantages > 0, algo.tau_pos, algo.tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return PolicyLossTerms(-gate * advantages, torch.zeros_like(ratio))


@register_policy_loss("gpg", token_level=True)
@register_policy_loss("reinforce", token_level=True)
def reinforce_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                   mask: torch.Tensor, algo: AlgorithmConfig) -> PolicyLossTerms:
    """The plain policy gradient, -A x log p: no ratio, no clip (GPG's loss; REINFORCE's)."""
    return PolicyLossTerms(-advantages * logprobs, torch.zeros_like(logprobs))


@register_policy_loss("geo_mean", loss_agg="seq-mean-token-mean", whole_sequences=True)
def geo_mean_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, algo: AlgorithmConfig) -> PolicyLossTerms:
    """GMPO: a sequence's ratio is the geometric mean of its tokens' ratios, each log-ratio
    clipped to [-low, high] on the side its advantage's sign makes pessimistic; the loss
    -A x ratio of the sequence's mean advantage, carried by each of its tokens (so that the
    per-sequence mean is the sequence's loss, the mean over sequences VeRL's)."""
    log_ratio = masked(logprobs - old_logprobs, mask)
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -algo.clip_ratio_low, algo.clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)
    tokens = mask.sum(-1, keepdim=True)
    ratio = torch.exp(masked(pessimistic, mask).sum(-1, keepdim=True) / (tokens + 1e-8))
    advantage = masked(advantages, mask).sum(-1, keepdim=True) / (tokens + 1e-8)
    clipped = log_ratio != clamped
    return PolicyLossTerms((-advantage * ratio).expand_as(logprobs), (clipped & (advantages > 0)).float(),
                           (clipped & (advantages < 0)).float())


@register_policy_loss("clip_cov", whole_sequences=True)
def clip_cov_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, algo: AlgorithmConfig) -> PolicyLossTerms:
    """Clip-Cov (entropy-collapse control): PPO's clipped surrogate, with a random
    `clip_cov_ratio` of the micro-batch's unclipped tokens whose covariance of advantage and
    log-prob lies in (clip_cov_lb, clip_cov_ub) cut out of the gradient (their loss x 0)."""
    ratio = _ratio(logprobs, old_logprobs, limit=float("inf"))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - algo.clip_ratio_low, 1 + algo.clip_ratio_high)
    on = mask > 0
    clip_by_origin = (clipped > unclipped) & on
    covariance = _covariance(advantages, logprobs.detach(), mask)
    candidates = torch.nonzero((covariance < algo.clip_cov_ub) & (covariance > algo.clip_cov_lb) & on
                               & ~clip_by_origin)
    count = max(int(algo.clip_cov_ratio * mask.sum().item()), 1)
    chosen = candidates[torch.randperm(len(candidates))[:count]] if len(candidates) else candidates
    keep = torch.ones_like(advantages)
    keep[chosen[:, 0], chosen[:, 1]] = 0
    return PolicyLossTerms(torch.maximum(unclipped, clipped) * keep, (keep == 0).float())


@register_policy_loss("kl_cov", whole_sequences=True)
def kl_cov_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, algo: AlgorithmConfig) -> PolicyLossTerms:
    """KL-Cov (entropy-collapse control): the unclipped surrogate -A x r, plus ppo_kl_coef x
    |log r| on the `kl_cov_ratio` of the micro-batch's tokens with the largest covariance of
    advantage and log-prob."""
    log_ratio = logprobs - old_logprobs
    per_token = -advantages * torch.exp(log_ratio)
    on = mask > 0
    covariance = _covariance(advantages, logprobs.detach(), mask)[on]
    count = max(1, int(covariance.numel() * algo.kl_cov_ratio))
    penalised = torch.zeros_like(per_token, dtype=torch.bool)
    if covariance.numel():
        rows, columns = torch.nonzero(on, as_tuple=True)
        top = torch.topk(covariance, min(count, covariance.numel())).indices
        penalised[rows[top], columns[top]] = True
    per_token = torch.where(penalised, per_token + algo.ppo_kl_coef * log_ratio.abs(), per_token)
    return PolicyLossTerms(per_token, penalised.float())


def _covariance(advantages: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each token's (A - mean A) x (log p - mean log p), the means over the micro-batch's response
    tokens; -inf outside them."""
    on = mask > 0
    count = mask.sum().clamp(min=1)
    centred_advantages = advantages - masked(advantages, mask).sum() / count
    centred_logprobs = logprobs - masked(logprobs, mask).sum() / count
    return torch.where(on, centred_advantages * centred_logprobs, float("-inf"))
