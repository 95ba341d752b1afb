"""PPO's critic (`algorithm.adv_estimator: gae`): its values before the advantages, the returns it
regresses on after them, and its own step on each mini-batch before the policy's (none of the
policy's while it warms up, `critic.warmup_steps`)."""

from __future__ import annotations

from transformers import PretrainedConfig

from rlsys.actors.phases import PhaseTimer
from rlsys.actors.train_worker import TrainWorker
from rlsys.algorithms.advantages import gae_advantages_and_returns
from rlsys.algorithms.value_loss import token_values, value_loss
from rlsys.config.loader import ConfigError
from rlsys.config.rl import AlgorithmConfig, CriticConfig
from rlsys.config.schema import RLJobConfig
from rlsys.data.batching import Batch
from rlsys.rl.batch import RLBatch
from rlsys.rl.extension import StepExtension, StepGroups


class Critic(StepExtension):
    def __init__(self, cfg: CriticConfig, algo: AlgorithmConfig):
        self.cfg, self.gamma, self.lam, self.loss_agg = cfg, algo.gamma, algo.lam, algo.loss_agg

    @classmethod
    def check(cls, job: RLJobConfig, model: PretrainedConfig) -> None:
        """A critic exists with gae; its returns are per row, not per episode, so it trains episodes of one
        segment."""
        rollout, gae = job.rollout, job.algorithm.adv_estimator == "gae"
        if job.critic.warmup_steps and not gae:
            raise ConfigError("critic.warmup_steps: there is no critic unless algorithm.adv_estimator is gae")
        segmented = rollout.agent_loop == "openai" or bool(rollout.context_hook)
        if segmented and rollout.train_segments == "all" and gae:
            raise ConfigError("rollout.train_segments: gae's critic returns are per segment, not per episode; "
                              "set rollout.train_segments: last (or an outcome estimator such as grpo)")

    def advantage_inputs(self, batch: RLBatch, groups: StepGroups, timer: PhaseTimer) -> None:
        with timer("values"):
            batch.values = groups.train.forward(batch.for_workers(), token_values, role="critic")[0]["values"]

    def adjust_advantages(self, batch: RLBatch) -> None:
        _, batch.returns = gae_advantages_and_returns(batch.advantage_inputs(), self.gamma, self.lam)

    def trains_actor(self, step: int) -> bool:
        return step > self.cfg.warmup_steps

    def before_actor_step(self, mini: Batch, counts: dict[str, float], groups: StepGroups) -> dict[str, float]:
        loss_fn = value_loss(counts, self.cfg.cliprange_value, self.loss_agg)
        return groups.train.run_data_parallel(TrainWorker.critic_step, mini, loss_fn=loss_fn)[0]
