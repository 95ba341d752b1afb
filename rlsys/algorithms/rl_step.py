"""The policy loss of one micro-batch: PPO-clip on GRPO advantages, plus an optional KL term."""

from __future__ import annotations

import torch
from torch import nn

from rlsys.algorithms.lm_loss import logprobs_of_labels
from rlsys.algorithms.policy_loss import aggregate, entropy_from_logits, kl_penalty, ppo_clip_loss
from rlsys.config.schema import AlgorithmConfig


def policy_step(model: nn.Module, micro: dict[str, torch.Tensor], counts: dict[str, int],
                algo: AlgorithmConfig) -> dict[str, float]:
    """Backward of this micro-batch's share of the mini-batch loss; returns metric shares.

    `micro` holds [B, T] tensors aligned with input_ids: loss_mask (1 on
    response tokens), advantages, old_logprobs and, with a KL term, ref_logprobs.
    """
    logits = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"], use_cache=False).logits
    logprobs = logprobs_of_labels(logits, micro["input_ids"])
    mask = micro["loss_mask"][:, 1:]
    pg, clipped = ppo_clip_loss(logprobs, micro["old_logprobs"][:, 1:], micro["advantages"][:, 1:],
                                algo.clip_ratio_low, algo.clip_ratio_high)
    per_token = pg
    kl = torch.zeros_like(pg)
    if algo.kl_coef > 0:
        kl = kl_penalty(logprobs, micro["ref_logprobs"][:, 1:], algo.kl_estimator)
        per_token = pg + algo.kl_coef * kl
    loss = aggregate(per_token, mask, algo.loss_agg, counts["tokens"], counts["sequences"])
    loss.backward()
    with torch.no_grad():
        entropy = entropy_from_logits(logits[:, :-1])
        return {
            "actor/pg_loss": aggregate(pg, mask, algo.loss_agg, counts["tokens"], counts["sequences"]).item(),
            "actor/clip_frac": _token_share(clipped, mask, counts["tokens"]),
            "actor/entropy": _token_share(entropy, mask, counts["tokens"]),
            "actor/kl": _token_share(kl, mask, counts["tokens"]),
        }


def _token_share(values: torch.Tensor, mask: torch.Tensor, global_tokens: int) -> float:
    return ((values * mask).sum() / global_tokens).item()
