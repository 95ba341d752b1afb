"""Per-token policy-gradient losses, chosen by name (`algorithm.policy_loss`), with
VeRL's semantics. Token tensors are [B, T] aligned with the targets; `mask` is 1 on
response tokens. How per-token terms become the loss: `rlsys.algorithms.aggregation`.

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
