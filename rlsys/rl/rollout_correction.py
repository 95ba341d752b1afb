"""Rollout corrections (`algorithm.rollout_correction`): the loss weights or rejects tokens by the ratio of
the trainer's log-probs to the engine's, so it reads the engine's as a [B, T] field; with batch-normalised
weights, each mini-batch's loss divides by the step's mean weight, taken over the old log-probs."""

from __future__ import annotations

from rlsys.algorithms.rollout_correction import is_weight_mean
from rlsys.config.rl import RolloutCorrectionConfig
from rlsys.rl.batch import RLBatch
from rlsys.rl.extension import StepExtension


class RolloutCorrection(StepExtension):
    def __init__(self, cfg: RolloutCorrectionConfig):
        self.cfg = cfg
        self.normalized = cfg.rollout_is_batch_normalize and cfg.rollout_is != "none"
        self.needs = frozenset({"rollout_logprobs", "old_logprobs"} if self.normalized else {"rollout_logprobs"})

    def loss_counts(self, batch: RLBatch) -> tuple[dict[str, float], dict[str, float]]:
        """The step's mean truncated importance weight, when the weights are batch-normalised."""
        if not self.normalized:
            return {}, {}
        mask = batch.loss_mask[:, 1:]
        mean = is_weight_mean(batch.old_logprobs[:, 1:], batch.rollout_logprobs[:, 1:], mask, self.cfg)
        mean = mean if mean > 1e-8 else 1.0  # no weight to speak of: left as they are, as VeRL leaves them
        return {"is_weight_mean": mean}, {"rollout_corr/batch_norm_factor": mean}
