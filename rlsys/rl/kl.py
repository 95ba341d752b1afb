"""KL to a frozen reference policy: as a term of the policy's loss (`algorithm.kl_coef`, the loss
takes it) or as a penalty on each token's reward (`algorithm.use_kl_in_reward`, with its
controller, adaptive or fixed)."""

from __future__ import annotations

from rlsys.actors.phases import PhaseTimer
from rlsys.algorithms.kl import KLController, kl_in_reward
from rlsys.config.rl import KLControlConfig
from rlsys.rl.batch import RLBatch
from rlsys.rl.extension import StepExtension, StepGroups


class KLInLoss(StepExtension):
    """The loss's KL term reads the reference's log-probs."""

    needs = frozenset({"ref_logprobs"})


class KLInReward(StepExtension):
    """Each token's reward less beta x its KL between the sampling policy and the reference."""

    needs = frozenset({"old_logprobs", "ref_logprobs"})

    def __init__(self, estimator: str, control: KLControlConfig):
        self.estimator, self.controller = estimator, KLController(control)

    def shape_rewards(self, batch: RLBatch, groups: StepGroups, timer: PhaseTimer) -> dict[str, float]:
        batch.token_rewards, metrics = kl_in_reward(batch.token_rewards, batch.old_logprobs, batch.ref_logprobs,
                                                    batch.loss_mask, self.estimator, self.controller)
        return metrics

    def state(self) -> dict:
        return {"kl_ctrl": self.controller}
