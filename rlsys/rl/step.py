"""One RL step, run by the driver (the single controller), phase after phase:

    rollout (generate, score) -> rows -> the trainer's passes -> token rewards -> advantages -> update -> sync

Each phase is a module of this package; each feature (`rlsys.rl.features`) hooks the phases it changes.
"""

from __future__ import annotations

import time

import torch

from rlsys.actors.phases import PhaseTimer
from rlsys.agents.trajectory import Trajectory, episode_rows
from rlsys.algorithms.advantages import episode_advantages, episode_ends
from rlsys.config.schema import RLJobConfig
from rlsys.data.batching import EpochSampler, collate_rollouts, on_last_response_token
from rlsys.data.image_tokens import ImageExpander, ImagePixels
from rlsys.rl.batch import RLBatch, Rollout
from rlsys.rl.extension import StepGroups
from rlsys.rl.features import Features
from rlsys.rl.metrics import agent_metrics, async_metrics, mismatch, sample_metrics
from rlsys.rl.passes import LogprobPasses
from rlsys.rl.rollout import RolloutPhase
from rlsys.rl.samples import sample_records, samples_due
from rlsys.rl.update import Update


class RLStep:
    def __init__(self, cfg: RLJobConfig, groups: StepGroups, features: Features, sampler: EpochSampler, stream, sync,
                 tokenizer, expander: ImageExpander | None):
        """`stream`: asynchronous modes' `RolloutStream` (None: synchronous); `sync`: the weight sync to the
        engines; `expander`: a vision-language model's, whose rows carry the prompts' pictures."""
        self.cfg, self.groups, self.features = cfg, groups, features
        self.stream, self.sync, self.tokenizer, self.expander = stream, sync, tokenizer, expander
        self.rollout = RolloutPhase(cfg, groups, sampler, stream, features)
        self.passes = LogprobPasses(groups.train, cfg, features.needs)
        self.update = Update(cfg, features, groups, old_from_trainer=self.passes.source == "trainer")
        self.samples: list[dict] = []
        """The last step's responses as rows for the trackers, when it was due to write them."""
        self.policy_version = 0
        """The step whose update the training group's weights hold (what a replaced engine is given)."""

    def run(self, step: int) -> dict[str, float]:
        timer, started, features, groups = PhaseTimer("rlvr", step), time.perf_counter(), self.features, self.groups
        batch = self.rows(self.rollout.collect(step, timer))
        features.add_inputs(batch, groups)
        pass_metrics = self.passes.run(batch, timer)
        batch.token_rewards = outcome_token_rewards(batch)
        reward_metrics = features.shape_rewards(batch, groups, timer)
        features.advantage_inputs(batch, groups, timer)
        batch.advantages = episode_advantages(batch.advantage_inputs(), batch.episode_of, self.cfg.algorithm)
        features.adjust_advantages(batch)
        self.samples = self._records(batch, step)
        with timer("update"):
            update_metrics = self.update.run(batch, step)
        update_metrics.update(groups.train.memory_peaks())  # the passes' and the update's
        self.policy_version = step
        with timer("sync"):
            sync_metrics = self._sync(step)
        timer.times["time/step_s"] = time.perf_counter() - started
        return {**batch.rollout.metrics, **reward_metrics, **self._sample_metrics(batch, step, timer), **pass_metrics,
                **update_metrics, **sync_metrics, **timer.times}

    def rows(self, rollout: Rollout) -> RLBatch:
        """Each episode's segments as rows of the batch, with the engine's log-probs of their sampled tokens."""
        segments, episode_of = episode_rows(rollout.episodes, self.cfg.rollout.train_segments)
        prompt_ids, pixels = self.prompts_with_pictures(segments)
        rows = collate_rollouts(prompt_ids, [s.response_ids for s in segments], self.tokenizer.pad_token_id,
                                [s.response_mask for s in segments], pixels)
        engine_logprobs = torch.tensor([lp for s in segments for lp in s.logprobs])
        return RLBatch(rollout, segments, torch.tensor(episode_of), rows, engine_logprobs)

    def prompts_with_pictures(self, samples: list[Trajectory]) -> tuple[list[list[int]], list[ImagePixels | None]]:
        """Each sample's prompt ids as the trainer's model reads them: a vision-language prompt's image pads
        expanded, with its pictures' pixels."""
        if self.expander is None:
            return [s.prompt_ids for s in samples], [None] * len(samples)
        prompts = self.groups.prompts
        return self.expander.expand_prompts([(s.prompt_ids, prompts[s.prompt_index].images) for s in samples])

    def _sync(self, step: int) -> dict[str, float]:
        """The update's weights to the engines (asynchronous modes without partial rollouts: once the
        groups in flight are done)."""
        if self.stream is not None and not self.cfg.train.partial_rollout:
            self.stream.drain()
        return self.sync.run(version=step)

    def _records(self, batch: RLBatch, step: int) -> list[dict]:
        if not samples_due(self.cfg, step):
            return []
        rollout = batch.rollout
        return sample_records(rollout.episodes, rollout.groups, rollout.scored, rollout.rewards, batch.advantages,
                              batch.loss_mask, batch.episode_of, self.tokenizer, self.cfg.tracking.samples_per_log)

    def _sample_metrics(self, batch: RLBatch, step: int, timer: PhaseTimer) -> dict[str, float]:
        """Lengths and throughput, agent turns and tool use, staleness, and the engine/trainer mismatch."""
        episodes, cfg = batch.rollout.episodes, self.cfg
        return {
            **sample_metrics(batch.segments, batch.rows, timer.times),
            **(agent_metrics(episodes, batch.segments) if cfg.rollout.agent_loop != "single_turn" else {}),
            **(async_metrics(batch.segments, step, self.stream, cfg.train.max_staleness)
               if self.stream is not None else {}),
            **mismatch(batch.sampler_logprobs, batch.engine_logprobs, batch.rows),
        }


def outcome_token_rewards(batch: RLBatch) -> torch.Tensor:
    """[B, T] each episode's reward on the last response token of its last segment, 0 elsewhere."""
    on_last_segment = torch.zeros(len(batch.segments)).masked_scatter(episode_ends(batch.episode_of),
                                                                      batch.rollout.rewards)
    return on_last_response_token(on_last_segment, batch.rows)
