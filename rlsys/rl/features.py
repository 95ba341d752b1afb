"""The job's step extensions, built from its config (`features_of`), and each hook run over all of them in
order (`Features`): what a phase of the step calls."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PretrainedConfig

from rlsys.actors.phases import PhaseTimer
from rlsys.agents.trajectory import Trajectory
from rlsys.config.schema import RLJobConfig
from rlsys.data.batching import Batch
from rlsys.rl.batch import RLBatch, Rollout
from rlsys.rl.critic import Critic
from rlsys.rl.dapo import DynamicSampling, OverlongPenalty
from rlsys.rl.distillation import Distillation
from rlsys.rl.extension import PASS_FIELDS, StepExtension, StepGroups
from rlsys.rl.kl import KLInLoss, KLInReward
from rlsys.rl.remax import ReMax
from rlsys.rl.rollout_correction import RolloutCorrection
from rlsys.rl.router_replay import RouterReplay
from rlsys.rl.token_baseline import TokenBaseline

EXTENSIONS: tuple[type[StepExtension], ...] = (DynamicSampling, OverlongPenalty, RouterReplay, RolloutCorrection,
                                               KLInLoss, KLInReward, Distillation, Critic, ReMax, TokenBaseline)
"""Every feature of the step, each checking the jobs that turn it on."""


def check_features(job: RLJobConfig, model: PretrainedConfig) -> None:
    """Each feature's rules on the job (`StepExtension.check`), before Ray starts."""
    for extension in EXTENSIONS:
        extension.check(job, model)


def features_of(cfg: RLJobConfig) -> Features:
    """The job's features, in the order their hooks run (a penalty for KL in the reward is taken before
    the teacher's; the critic's step before the policy's)."""
    algo, found = cfg.algorithm, []
    if algo.filter_groups:
        found.append(DynamicSampling(algo.max_sampling_rounds, cfg.train.prompts_per_step))
    if cfg.reward.overlong_buffer_len:
        found.append(OverlongPenalty(cfg.reward, cfg.rollout.response_budget))
    if algo.router_replay != "none":
        found.append(RouterReplay(algo.router_replay, cfg.model.path))
    if algo.rollout_correction.active:
        found.append(RolloutCorrection(algo.rollout_correction))
    if algo.kl_coef > 0:
        found.append(KLInLoss())
    if algo.use_kl_in_reward:
        found.append(KLInReward(algo.kl_penalty, algo.kl_ctrl))
    if algo.distill is not None:
        found.append(Distillation(algo.distill))
    if algo.adv_estimator == "gae":
        found.append(Critic(cfg.critic, algo))
    if algo.adv_estimator == "remax":
        found.append(ReMax(cfg.rollout.agent_loop))
    if TokenBaseline.estimates(algo.adv_estimator):
        found.append(TokenBaseline(algo.rollout_correction))
    return Features(found)


class Features:
    """The job's extensions; each method runs one hook of every one of them, in order."""

    def __init__(self, extensions: list[StepExtension]):
        for ext in extensions:
            if not ext.needs <= set(PASS_FIELDS):
                raise ValueError(f"{type(ext).__name__} needs {sorted(ext.needs - set(PASS_FIELDS))}: the passes give "
                                 f"{', '.join(PASS_FIELDS)}")
        self.extensions = extensions

    @property
    def needs(self) -> frozenset[str]:
        """What the extensions read from the trainer's passes before the update."""
        return frozenset().union(*(ext.needs for ext in self.extensions))

    @property
    def draws(self) -> int:
        return max((ext.draws for ext in self.extensions), default=1)

    def rollout_rewards(self, samples: list[Trajectory], rewards: torch.Tensor) -> torch.Tensor:
        for ext in self.extensions:
            rewards = ext.rollout_rewards(samples, rewards)
        return rewards

    def keep_groups(self, scores: torch.Tensor, n: int) -> list[bool]:
        """The groups every extension keeps."""
        keep = torch.ones(len(scores) // n, dtype=torch.bool)
        for ext in self.extensions:
            kept = ext.keep_groups(scores, n)
            if kept is not None:
                keep &= kept
        return keep.tolist()

    def rollout_metrics(self, rollout: Rollout, draws: int, kept_groups: int) -> dict[str, float]:
        metrics = {}
        for ext in self.extensions:
            metrics.update(ext.rollout_metrics(rollout, draws, kept_groups))
        return metrics

    def on_draw(self, prompts: list[tuple], seed: int, step: int, groups: StepGroups) -> None:
        for ext in self.extensions:
            ext.on_draw(prompts, seed, step, groups)

    def add_inputs(self, batch: RLBatch, groups: StepGroups) -> None:
        for ext in self.extensions:
            ext.add_inputs(batch, groups)

    def shape_rewards(self, batch: RLBatch, groups: StepGroups, timer: PhaseTimer) -> dict[str, float]:
        metrics = {}
        for ext in self.extensions:
            metrics.update(ext.shape_rewards(batch, groups, timer))
        return metrics

    def advantage_inputs(self, batch: RLBatch, groups: StepGroups, timer: PhaseTimer) -> None:
        for ext in self.extensions:
            ext.advantage_inputs(batch, groups, timer)

    def adjust_advantages(self, batch: RLBatch) -> None:
        for ext in self.extensions:
            ext.adjust_advantages(batch)

    def loss_counts(self, batch: RLBatch) -> tuple[dict[str, float], dict[str, float]]:
        counts, metrics = {}, {}
        for ext in self.extensions:
            more_counts, more_metrics = ext.loss_counts(batch)
            counts.update(more_counts)
            metrics.update(more_metrics)
        return counts, metrics

    def trains_actor(self, step: int) -> bool:
        return all(ext.trains_actor(step) for ext in self.extensions)

    def before_actor_step(self, mini: Batch, counts: dict[str, float], groups: StepGroups) -> dict[str, float]:
        metrics = {}
        for ext in self.extensions:
            metrics.update(ext.before_actor_step(mini, counts, groups))
        return metrics

    def state(self) -> dict[str, Any]:
        return {name: obj for ext in self.extensions for name, obj in ext.state().items()}

    def of_kind(self, kind: type[StepExtension]) -> StepExtension | None:
        """The job's extension of this class (None: the feature is off)."""
        return next((ext for ext in self.extensions if isinstance(ext, kind)), None)
