"""The rollout phase: the step's prompts sampled by the engines (an agent loop per episode), or taken from
what they sampled ahead (asynchronous modes), scored by the reward terms, the rewards shaped and the groups
kept as the extensions say (DAPO's overlong penalty and dynamic sampling: drawn again until the step has
enough groups of mixed scores); the engines then free their memory for the trainer."""

from __future__ import annotations

import logging

import torch

from rlsys.actors.phases import PhaseTimer
from rlsys.agents.trajectory import Trajectory
from rlsys.config.schema import RLJobConfig
from rlsys.data.batching import EpochSampler
from rlsys.rewards.model_terms import exchanges
from rlsys.rewards.scoring import ScoredSample, reward_inputs
from rlsys.rl.batch import Rollout
from rlsys.rl.extension import StepGroups
from rlsys.rl.features import Features
from rlsys.rl.metrics import dropped_metrics
from rlsys.seeds import draw_seed

log = logging.getLogger(__name__)


class RolloutPhase:
    def __init__(self, cfg: RLJobConfig, groups: StepGroups, sampler: EpochSampler, stream, features: Features):
        """`stream`: asynchronous modes' `RolloutStream` (None: the step samples its own prompts)."""
        self.cfg, self.groups, self.sampler, self.stream, self.features = cfg, groups, sampler, stream, features

    def collect(self, step: int, timer: PhaseTimer) -> Rollout:
        cfg, n, wanted = self.cfg, self.cfg.rollout.n, self.cfg.train.prompts_per_step
        kept_groups, others, errors = [], [], 0.0
        for draw in range(self.features.draws):
            with timer("generate"):
                samples = self._generate(step, draw, timer)
            with timer("reward"):
                scored, draw_metrics = self.groups.rewards.score(reward_inputs(samples, self.groups.prompts),
                                                                 exchanges(samples, self.groups.prompts))
            errors += draw_metrics["reward/errors"]
            scores = torch.tensor([s.score for s in scored])
            rewards = self.features.rollout_rewards(samples, scores)
            for g, kept in enumerate(self.features.keep_groups(scores, n)):  # by score, not by shaped reward
                group = (samples[g * n:(g + 1) * n], scored[g * n:(g + 1) * n], rewards[g * n:(g + 1) * n])
                (kept_groups if kept else others).append(group)
            if len(kept_groups) >= wanted:
                break
        freed = self.groups.rollout.release_memory()
        if len(kept_groups) < wanted:
            log.warning("step %d: %d of %d prompt groups have mixed rewards after %d draws; filling with "
                        "equal-reward groups", step, len(kept_groups), wanted, draw + 1)
        groups = (kept_groups + others)[:wanted]
        samples = [s for group in groups for s in group[0]]
        scored = [s for group in groups for s in group[1]]
        rewards = torch.cat([group[2] for group in groups])
        kept = [i for i, sample in enumerate(samples) if not sample.dropped]
        dropped = dropped_metrics(samples, step) if cfg.rollout.agent_loop != "single_turn" else {}
        samples, scored, rewards = [samples[i] for i in kept], [scored[i] for i in kept], rewards[kept]
        metrics = {"reward/mean": rewards.mean().item(),
                   "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
                   **self._accuracy(scored), **self.groups.rewards.metrics(scored), "reward/errors": errors, **dropped}
        if freed is not None:
            metrics["rollout/freed_gib"] = freed / 2**30
        rollout = Rollout(samples, torch.tensor(kept) // n, scored, rewards, metrics)
        metrics.update(self.features.rollout_metrics(rollout, draw + 1, len(kept_groups)))
        return rollout

    def _generate(self, step: int, draw: int, timer: PhaseTimer) -> list[Trajectory]:
        """One prompt batch's trajectories, n per prompt in order: generated now, or (asynchronous
        modes) taken from what the engines generated ahead, for the policy of version step - 1."""
        cfg, engines = self.cfg, self.groups.rollout
        if self.stream is not None:
            return [t for group in self.stream.take(cfg.train.prompts_per_step, version=step - 1) for t in group]
        indices, seed = self.sampler.next_indices(), draw_seed(cfg.seed, step, draw)
        prompts = [(i, self.groups.prompts[i].ids, self.groups.prompts[i].row) for i in indices]
        samples, engine_times = engines.rollout(prompts, cfg.rollout.agent_loop, cfg.rollout.n, engines.sampling(),
                                                seed, version=step - 1)  # the policy the last step synced
        timer.times["time/engine_s"] = timer.times.get("time/engine_s", 0.0) + engine_times["engine_s"]
        self.features.on_draw(prompts, seed, step, self.groups)
        return samples

    def _accuracy(self, scored: list[ScoredSample]) -> dict[str, float]:
        """The share of responses the first reward term scores 1 or more (none without terms)."""
        terms = self.groups.rewards.terms
        if not terms:
            return {}
        return {"reward/accuracy": sum(s.terms[terms[0].label] >= 1.0 for s in scored) / len(scored)}
