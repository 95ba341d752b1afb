"""The reward model's loss for a rank's model (`RankModel`): Bradley-Terry on preference pairs.

The model is the policy's backbone with a one-output head in place of the LM head (as the
critic's, `rlsys.trainer.loading`), so its "logits" are [B, T, 1]; a sequence's score is the
value at its last token (where its loss mask is 1), as a sequence-classification model scores it.
Rows come in pairs, chosen then rejected (`rlsys.data.preferences`), and a micro-batch holds
whole pairs. A partial, not a closure (see `lm_loss`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from rlsys.algorithms.lm_loss import LossOutput
from rlsys.data.batching import Batch


def bradley_terry_loss(num_pairs: int) -> Callable[[torch.Tensor, Batch], LossOutput]:
    """-log sigmoid(score(chosen) - score(rejected)), summed over this micro-batch's pairs and
    divided by the step's pairs (every rank's), so the micro-batches' losses add up to the mean."""
    return partial(_bradley_terry, num_pairs=num_pairs)


def sequence_scores(logits: torch.Tensor, micro: Batch) -> torch.Tensor:
    """The value at each row's scored token (its loss mask's one position), [B]."""
    mask = micro["loss_mask"].to(logits.device).bool()
    return torch.where(mask, logits[..., 0].float(), 0.0).sum(-1)


def _bradley_terry(logits: torch.Tensor, micro: Batch, *, num_pairs: int) -> LossOutput:
    scores = sequence_scores(logits, micro)
    margin = scores[0::2] - scores[1::2]
    loss = -F.logsigmoid(margin).sum() / num_pairs
    with torch.no_grad():
        metrics = {"loss": loss.detach(), "rm/accuracy": (margin > 0).float().sum() / num_pairs,
                   "rm/margin": margin.sum() / num_pairs,
                   "rm/chosen_score": scores[0::2].sum() / num_pairs}
    return LossOutput(loss, metrics)
