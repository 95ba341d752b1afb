"""The policy loss of one micro-batch: PPO-clip on GRPO advantages, plus an optional KL term,
as a pure loss function for the model engine."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from rlsys.algorithms.lm_loss import Batch, LossOutput, logprobs_of_labels
from rlsys.algorithms.policy_loss import aggregate, entropy_from_logits, kl_penalty, ppo_clip_loss
from rlsys.config.schema import AlgorithmConfig


def policy_loss(counts: dict[str, int], algo: AlgorithmConfig) -> Callable[[torch.Tensor, Batch], LossOutput]:
    """`counts`: the mini-batch's global response tokens and sequences. A micro-batch holds
    [B, T] tensors aligned with input_ids: loss_mask (1 on response tokens), advantages,
    old_logprobs (absent when the update is on-policy: the current log-probs, detached, are
    the old ones) and, with a KL term, ref_logprobs. Its rows output the current log-probs."""

    def loss_fn(logits: torch.Tensor, micro: Batch) -> LossOutput:
        micro = {k: v.to(logits.device) for k, v in micro.items()}
        logprobs = logprobs_of_labels(logits, micro["input_ids"])
        mask = micro["loss_mask"][:, 1:]
        old_logprobs = micro["old_logprobs"][:, 1:] if "old_logprobs" in micro else logprobs.detach()
        pg, clipped = ppo_clip_loss(logprobs, old_logprobs, micro["advantages"][:, 1:],
                                    algo.clip_ratio_low, algo.clip_ratio_high)
        per_token, kl = pg, torch.zeros_like(pg)
        if algo.kl_coef > 0:
            kl = kl_penalty(logprobs, micro["ref_logprobs"][:, 1:], algo.kl_estimator)
            per_token = pg + algo.kl_coef * kl
        loss = aggregate(per_token, mask, algo.loss_agg, counts["tokens"], counts["sequences"])
        with torch.no_grad():
            entropy = entropy_from_logits(logits[:, :-1])
            if isinstance(entropy, DTensor):
                entropy = entropy.full_tensor()
            metrics = {
                "actor/pg_loss": aggregate(pg, mask, algo.loss_agg, counts["tokens"], counts["sequences"]),
                "actor/clip_frac": _token_share(clipped, mask, counts["tokens"]),
                "actor/entropy": _token_share(entropy, mask, counts["tokens"]),
                "actor/kl": _token_share(kl, mask, counts["tokens"]),
            }
        return LossOutput(loss, metrics, rows={"logprobs": F.pad(logprobs.detach(), (1, 0))})

    return loss_fn


def _token_share(values: torch.Tensor, mask: torch.Tensor, global_tokens: int) -> torch.Tensor:
    return (values * mask).sum() / global_tokens
