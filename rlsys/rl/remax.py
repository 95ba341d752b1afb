"""ReMax (`algorithm.adv_estimator: remax`): beside each prompt draw's samples, a greedy response to
every prompt, whose score is that prompt's baseline."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from rlsys.actors.phases import PhaseTimer
from rlsys.config.loader import ConfigError
from rlsys.config.schema import RLJobConfig
from rlsys.rewards.model_terms import exchanges
from rlsys.rewards.scoring import reward_inputs
from rlsys.rl.batch import RLBatch
from rlsys.rl.extension import StepExtension, StepGroups


class ReMax(StepExtension):
    def __init__(self, agent_loop: str):
        self.agent_loop = agent_loop
        self.baselines: dict[int, float] = {}
        """The score of the greedy response to each prompt of the step, by prompt index."""

    @classmethod
    def check(cls, job: RLJobConfig, model: PretrainedConfig) -> None:
        if job.algorithm.adv_estimator == "remax" and job.train.async_mode != "off":
            raise ConfigError("algorithm.adv_estimator: remax generates its greedy baselines in the step; not with "
                              "train.async_mode")

    def on_draw(self, prompts: list[tuple], seed: int, step: int, groups: StepGroups) -> None:
        greedy, _ = groups.rollout.rollout(prompts, self.agent_loop, 1, groups.rollout.sampling(temperature=0.0), seed,
                                           version=step - 1)
        scored, _ = groups.rewards.score(reward_inputs(greedy, groups.prompts), exchanges(greedy, groups.prompts))
        self.baselines.update({g.prompt_index: s.score for g, s in zip(greedy, scored)})

    def advantage_inputs(self, batch: RLBatch, groups: StepGroups, timer: PhaseTimer) -> None:
        greedy = torch.tensor([self.baselines[e.prompt_index] for e in batch.rollout.episodes])
        batch.reward_baselines = greedy[batch.episode_of]
