"""The optimal token baselines (`algorithm.adv_estimator: optimal_token_baseline` and its tool-integrated
variant): the estimator weights each position by the old pass's probabilities and sums of squared
probabilities, and by the squared rollout importance weights when `rollout_correction.rollout_is` is on."""

from __future__ import annotations

from transformers import PretrainedConfig

from rlsys.actors.phases import PhaseTimer
from rlsys.algorithms.rollout_correction import rollout_is_weights
from rlsys.config.loader import ConfigError
from rlsys.config.rl import RolloutCorrectionConfig
from rlsys.config.schema import RLJobConfig
from rlsys.rl.batch import RLBatch
from rlsys.rl.extension import StepExtension, StepGroups

ESTIMATORS = ("optimal_token_baseline", "tir_optimal_token_baseline")


class TokenBaseline(StepExtension):
    needs = frozenset({"old_logprobs", "sum_pi_squared"})

    def __init__(self, correction: RolloutCorrectionConfig):
        self.correction = correction

    @staticmethod
    def estimates(adv_estimator: str) -> bool:
        return adv_estimator in ESTIMATORS

    @classmethod
    def check(cls, job: RLJobConfig, model: PretrainedConfig) -> None:
        algo = job.algorithm
        if cls.estimates(algo.adv_estimator) and (algo.old_logprobs in ("current", "rollout")
                                                  or algo.router_replay == "r2" or algo.rollout_correction.bypass_mode):
            raise ConfigError(f"algorithm.adv_estimator: {algo.adv_estimator} reads the sums of squared probabilities "
                              "of the trainer's old-log-prob pass: needs old_logprobs: auto or trainer, without "
                              "router_replay: r2 or bypass_mode")

    def advantage_inputs(self, batch: RLBatch, groups: StepGroups, timer: PhaseTimer) -> None:
        if self.correction.rollout_is != "none" and batch.rollout_logprobs is not None:
            batch.is_weights = rollout_is_weights(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask,
                                                  self.correction)
