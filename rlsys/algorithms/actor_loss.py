"""The actor's loss of one micro-batch, as a pure loss function for a rank's model: the
configured policy-gradient loss (`algorithm.policy_loss`) on the batch's advantages, corrected
for the engine/trainer mismatch where it is on (`algorithm.rollout_correction`), plus an
optional KL term, aggregated by `algorithm.loss_agg`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from rlsys.algorithms.aggregation import aggregate, aggregates_per_sequence, masked, token_share
from rlsys.algorithms.distill import TOP_IDS, TOP_LOGPROBS, top_k_forward_kl
from rlsys.algorithms.kl import kl_penalty
from rlsys.algorithms.lm_loss import (
    LossOutput,
    entropy_from_logits,
    logprobs_at,
    logprobs_of_labels,
    sampling_logits,
    token_level,
)
from rlsys.algorithms.policy_loss import POLICY_LOSSES, PolicyLoss
from rlsys.algorithms.rollout_correction import correction_factors
from rlsys.config.rl import AlgorithmConfig
from rlsys.data.batching import Batch


@dataclass(frozen=True)
class ActorInputs:
    """Which optional fields a micro-batch holds beside input_ids, loss_mask and advantages, each [B, T]
    and aligned with input_ids: the loss reads what is declared here, never probing the batch's keys."""

    old_logprobs: bool = False
    """The sampling policy's (an off-policy update); without them the current log-probs, detached, are
    the old ones."""
    rollout_logprobs: bool = False
    """The engine's: the rollout corrections of `algorithm.rollout_correction` weight by them."""
    ref_logprobs: bool = False
    """The reference policy's, which the KL term of `algorithm.kl_coef` needs."""
    teacher_top_k: bool = False
    """A teacher's top-k tokens and their log-probs ([B, T, k]): the top-k distillation term."""


def actor_loss(counts: dict[str, int], algo: AlgorithmConfig, inputs: ActorInputs = ActorInputs(),
               temperature: float = 1.0, with_logprobs: bool = True) -> Callable[[torch.Tensor, Batch], LossOutput]:
    """`counts`: the mini-batch's global response "tokens" and "sequences", and the "horizon"
    (generation budget per response); `inputs`: the optional fields each micro-batch holds;
    `temperature`: the rollout's (`sampling_logits`).

    Its rows output the current log-probs when `with_logprobs` (each row costs a transfer, and a
    gather under context parallel). Values outside the mask (padding) never reach the loss, NaN
    included. (A partial, see `rlsys.algorithms.lm_loss`.)"""
    if algo.kl_coef > 0 and not inputs.ref_logprobs:
        raise ValueError("algorithm.kl_coef > 0: the actor loss needs the batch's ref_logprobs")
    loss_kind = POLICY_LOSSES[policy_loss_name(algo)]
    loss_agg = loss_kind.loss_agg or algo.loss_agg
    loss_fn = partial(_actor_loss, loss_kind=loss_kind, loss_agg=loss_agg, counts=counts, algo=algo, inputs=inputs,
                      temperature=temperature, with_logprobs=with_logprobs)
    per_row = aggregates_per_sequence(loss_agg) or algo.rollout_correction.per_sequence
    return token_level(loss_fn) if loss_kind.token_level and not per_row else loss_fn


def policy_loss_name(algo: AlgorithmConfig) -> str:
    """The policy loss of the update: `algorithm.policy_loss`, or in bypass mode the one its
    `loss_type` names (ppo_clip: vanilla; reinforce), as VeRL's bypass_mode loss dispatches."""
    correction = algo.rollout_correction
    if correction.bypass_mode:
        return "reinforce" if correction.loss_type == "reinforce" else "vanilla"
    return algo.policy_loss


def _actor_loss(logits: torch.Tensor, micro: Batch, *, loss_kind: PolicyLoss, loss_agg: str,
                 counts: dict[str, int], algo: AlgorithmConfig, inputs: ActorInputs, temperature: float,
                 with_logprobs: bool) -> LossOutput:
    micro = {k: v.to(logits.device) for k, v in micro.items()}
    model_logits, logits = logits, sampling_logits(logits, temperature)
    logprobs = logprobs_of_labels(logits, micro["input_ids"])
    mask = micro["loss_mask"][:, 1:]
    current = logprobs.detach()
    # padding may hold NaN or inf from the engine or the data: it never enters a ratio or a KL
    old_logprobs = masked(micro["old_logprobs"][:, 1:], mask, current) if inputs.old_logprobs else current
    advantages = masked(micro["advantages"][:, 1:], mask)
    terms = loss_kind.fn(logprobs, old_logprobs, advantages, mask, algo)
    pg_per_token, is_metrics = terms.per_token, {}
    if inputs.rollout_logprobs:
        correction = algo.rollout_correction
        # bypass mode: the old log-probs are the engine's, and the ratio to correct is the current policy's
        factors, is_metrics = correction_factors(current if correction.bypass_mode else old_logprobs,
                                                 micro["rollout_logprobs"][:, 1:], mask, correction,
                                                 counts.get("is_weight_mean", 1.0),
                                                 weighted=not (correction.bypass_mode
                                                               and correction.loss_type == "ppo_clip"))
        pg_per_token = pg_per_token * factors
    per_token, kl = pg_per_token, torch.zeros_like(current)
    if inputs.ref_logprobs and algo.kl_coef > 0:
        kl = kl_penalty(logprobs, masked(micro["ref_logprobs"][:, 1:], mask, current), algo.kl_estimator)
        per_token = per_token + algo.kl_coef * kl
    distill_metrics = {}
    if inputs.teacher_top_k:
        distilled, distill_metrics = _top_k_distillation(model_logits, micro, mask, counts)
        per_token = per_token + algo.distill.coef * distilled
    loss = aggregate(per_token, mask, loss_agg, counts)
    with torch.no_grad():
        moved = current - old_logprobs  # how far this update's policy is from the old one on these tokens
        entropy = entropy_from_logits(logits[:, :-1])
        if isinstance(entropy, DTensor):
            entropy = entropy.full_tensor()
        metrics = {
            "actor/pg_loss": aggregate(pg_per_token, mask, loss_agg, counts),
            "actor/clip_frac": token_share(terms.clipped, mask, counts),
            "actor/entropy": token_share(entropy, mask, counts),
            "actor/kl": token_share(kl, mask, counts),
            "actor/ppo_kl": token_share(-moved, mask, counts),  # VeRL's ppo_kl
            "actor/log_ratio_abs": token_share(moved.abs(), mask, counts),
        }
        if terms.clipped_lower is not None:
            metrics["actor/clip_frac_lower"] = token_share(terms.clipped_lower, mask, counts)
        metrics.update({name: token_share(values, mask, counts) for name, values in is_metrics.items()})
        metrics.update(distill_metrics)
    return LossOutput(loss, metrics, rows={"logprobs": F.pad(current, (1, 0))} if with_logprobs else {})


def _top_k_distillation(logits: torch.Tensor, micro: Batch, mask: torch.Tensor, counts: dict[str, int]
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token KL from the teacher to the policy (at temperature 1, the teacher's) over the
    teacher's top-k tokens, [B, T-1], and its metrics: the KL, and the probability mass the
    teacher and the policy put on those k tokens."""
    policy = logprobs_at(logits, micro[TOP_IDS])
    teacher = micro[TOP_LOGPROBS][:, 1:]
    kl = top_k_forward_kl(policy, masked(teacher, mask.unsqueeze(-1)))
    with torch.no_grad():
        metrics = {"distill/top_k_kl": token_share(kl, mask, counts),
                   "distill/teacher_top_k_mass": token_share(teacher.exp().sum(-1), mask, counts),
                   "distill/policy_top_k_mass": token_share(policy.exp().sum(-1), mask, counts)}
    return masked(kl, mask), metrics
