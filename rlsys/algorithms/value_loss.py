"""The critic's loss functions for a rank's model (PPO with `adv_estimator: gae`).

The critic is the policy's backbone with a one-output head where the LM head was
(`rlsys.trainer.loading`), so its "logits" are [B, T, 1] values. As with log-probs,
the value of response token t is read at position t - 1: the state before the
token was generated.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from rlsys.algorithms.aggregation import aggregate, aggregates_per_sequence, masked, token_share
from rlsys.algorithms.lm_loss import LossOutput, token_level
from rlsys.data.batching import Batch


@token_level
def token_values(logits: torch.Tensor, micro: Batch) -> LossOutput:
    """Forward only: values [B, T] aligned with input_ids (column 0 is 0)."""
    return LossOutput(None, rows={"values": F.pad(logits[:, :-1, 0].float(), (1, 0))})


def value_loss(counts: dict[str, int], cliprange: float, loss_agg: str) -> Callable[[torch.Tensor, Batch], LossOutput]:
    """PPO's clipped value loss: 0.5 x max((v - R)^2, (clip(v, v_old +- cliprange) - R)^2),
    aggregated like the policy loss. A micro-batch holds loss_mask, values (the critic's
    before this update) and returns, [B, T] aligned with input_ids."""
    loss_fn = partial(_value_loss, counts=counts, cliprange=cliprange, loss_agg=loss_agg)
    return loss_fn if aggregates_per_sequence(loss_agg) else token_level(loss_fn)


def _value_loss(logits: torch.Tensor, micro: Batch, *, counts: dict[str, int], cliprange: float,
                loss_agg: str) -> LossOutput:
    micro = {k: v.to(logits.device) for k, v in micro.items()}
    mask = micro["loss_mask"][:, 1:]
    predicted = logits[:, :-1, 0].float()
    old = masked(micro["values"][:, 1:], mask, predicted.detach())
    returns = masked(micro["returns"][:, 1:], mask)
    clipped = old + (predicted - old).clamp(-cliprange, cliprange)
    unclipped_loss, clipped_loss = (predicted - returns).square(), (clipped - returns).square()
    loss = 0.5 * aggregate(torch.maximum(unclipped_loss, clipped_loss), mask, loss_agg, counts)
    with torch.no_grad():
        metrics = {
            "critic/vf_loss": loss.detach(),
            "critic/vf_clipfrac": token_share((clipped_loss > unclipped_loss).float(), mask, counts),
            "critic/vpred_mean": token_share(predicted, mask, counts),
        }
    return LossOutput(loss, metrics)
