"""DAPO's two changes to what a step trains on, as extensions of the rollout (`rlsys.algorithms.dapo`):
dynamic sampling (`algorithm.filter_groups`) keeps the groups whose scores differ, drawing prompts again
until the step has enough, and the overlong penalty (`reward.overlong_buffer_len`) lowers the reward of a
response that ran into the last tokens of its budget."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from rlsys.agents.trajectory import Trajectory
from rlsys.algorithms.dapo import mixed_groups, overlong_penalty
from rlsys.config.loader import ConfigError
from rlsys.config.rl import RewardConfig
from rlsys.config.schema import RLJobConfig
from rlsys.rl.batch import Rollout
from rlsys.rl.extension import StepExtension


class DynamicSampling(StepExtension):
    """A step's groups are those of mixed scores, from up to `max_draws` prompt draws (the rest fill in
    when too few are)."""

    def __init__(self, max_draws: int, wanted: int):
        self.draws, self.wanted = max_draws, wanted

    @classmethod
    def check(cls, job: RLJobConfig, model: PretrainedConfig) -> None:
        if not job.algorithm.filter_groups:
            return
        if job.rollout.n < 2:
            raise ConfigError("algorithm.filter_groups: needs groups of rollout.n >= 2 responses")
        if job.train.async_mode != "off":
            raise ConfigError("algorithm.filter_groups: DAPO's dynamic sampling draws prompts a step at a time; "
                              "not with train.async_mode")

    def keep_groups(self, scores: torch.Tensor, n: int) -> torch.Tensor | None:
        return mixed_groups(scores, n)

    def rollout_metrics(self, rollout: Rollout, draws: int, kept_groups: int) -> dict[str, float]:
        return {"dapo/draws": draws, "dapo/mixed_groups": min(kept_groups, self.wanted) / self.wanted}


class OverlongPenalty(StepExtension):
    """A response's reward less its penalty for running into the last `reward.overlong_buffer_len` tokens of
    its budget."""

    def __init__(self, reward: RewardConfig, response_budget: int):
        self.buffer_len, self.factor = reward.overlong_buffer_len, reward.overlong_penalty_factor
        self.budget = response_budget

    @classmethod
    def check(cls, job: RLJobConfig, model: PretrainedConfig) -> None:
        if job.reward.overlong_buffer_len >= job.rollout.response_budget:
            raise ConfigError(f"reward.overlong_buffer_len: {job.reward.overlong_buffer_len} must be below the "
                              f"response budget (rollout.max_response_tokens, else rollout.max_new_tokens: "
                              f"{job.rollout.response_budget})")

    def rollout_rewards(self, samples: list[Trajectory], rewards: torch.Tensor) -> torch.Tensor:
        lengths = torch.tensor([len(s.response_ids) for s in samples])
        return rewards + overlong_penalty(lengths, self.budget, self.buffer_len, self.factor)

    def rollout_metrics(self, rollout: Rollout, draws: int, kept_groups: int) -> dict[str, float]:
        scores = torch.tensor([s.score for s in rollout.scored])
        return {"reward/overlong_penalty": (rollout.rewards - scores).mean().item()}
