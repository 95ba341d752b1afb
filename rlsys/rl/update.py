"""The update phase: `algorithm.ppo_epochs` passes over the step's rows in mini-batches of whole prompt
groups, each giving the extensions their step (the critic's) and then the policy its step."""

from __future__ import annotations

import torch

from rlsys.actors.train_worker import TrainWorker
from rlsys.algorithms.actor_loss import actor_loss
from rlsys.config.loader import ConfigError
from rlsys.config.schema import RLJobConfig
from rlsys.data.batching import Batch, num_targets, split_rows
from rlsys.rl.batch import RLBatch
from rlsys.rl.extension import StepGroups
from rlsys.rl.features import Features
from rlsys.trainer.rank_model import UPDATE_TOKENS


def mini_batches_per_step(cfg: RLJobConfig) -> int:
    """Policy updates per epoch: mini-batches of `algorithm.ppo_mini_batch_size` prompts (0: one)."""
    mini = cfg.algorithm.ppo_mini_batch_size
    return cfg.train.prompts_per_step // mini if mini else 1


def updates_per_step(cfg: RLJobConfig) -> int:
    return cfg.algorithm.ppo_epochs * mini_batches_per_step(cfg)


class Update:
    def __init__(self, cfg: RLJobConfig, features: Features, groups: StepGroups, old_from_trainer: bool):
        self.algo, self.temperature, self.horizon = cfg.algorithm, cfg.rollout.temperature, cfg.rollout.response_budget
        self.mini_batches, self.updates = mini_batches_per_step(cfg), updates_per_step(cfg)
        self.features, self.groups, self.old_from_trainer = features, groups, old_from_trainer

    def run(self, batch: RLBatch, step: int) -> dict[str, float]:
        """The update's mean metrics. Sets batch.sampler_logprobs: the old pass's log-probs, else the first
        mini-batch's, taken by its update before any optimizer step (None when neither exists)."""
        train_actor = self.features.trains_actor(step)
        batch.sampler_logprobs = batch.old_logprobs if self.old_from_trainer else None
        extra_counts, sums = self.features.loss_counts(batch)
        rows = batch.for_workers()
        for _ in range(self.algo.ppo_epochs):
            for mini in split_rows(rows, self.mini_batches):
                counts = {**self.loss_counts(mini), **extra_counts}
                metrics = self.features.before_actor_step(mini, counts, self.groups)
                if train_actor:
                    metrics.update(self._actor_step(mini, counts, batch))
                for name, value in metrics.items():  # an update's mean; the tokens an epoch computed
                    sums[name] = sums.get(name, 0.0) + value / (self.algo.ppo_epochs if name == UPDATE_TOKENS
                                                                else self.updates)
        return sums

    def loss_counts(self, mini: Batch) -> dict[str, float]:
        """What a mini-batch's loss divides by, over every rank and micro-batch: its response "tokens" and
        "sequences", and the "horizon" (the response budget)."""
        return {"tokens": num_targets(mini), "sequences": mini["input_ids"].shape[0], "horizon": self.horizon}

    def _actor_step(self, mini: Batch, counts: dict[str, float], batch: RLBatch) -> dict[str, float]:
        wants_rows = batch.sampler_logprobs is None  # only the first mini-batch's, and only once
        loss_fn = actor_loss(counts, self.algo, batch.actor_inputs(), self.temperature, with_logprobs=wants_rows)
        outputs = self.groups.train.run_data_parallel(TrainWorker.train_step, mini, loss_fn=loss_fn)
        if wants_rows:
            batch.sampler_logprobs = torch.cat([rows["logprobs"] for _, rows in outputs])
        return {f"actor/{k}" if k in ("grad_norm", "lr") else k: v for k, v in outputs[0][0].items()}


def check_update_batches(cfg: RLJobConfig, dp: int) -> None:
    """The step's prompts split into whole mini-batches, and each update's responses evenly over the
    data-parallel ranks."""
    prompts, mini = cfg.train.prompts_per_step, cfg.algorithm.ppo_mini_batch_size
    if mini and prompts % mini:
        raise ConfigError(f"algorithm.ppo_mini_batch_size: {mini} does not divide train.prompts_per_step ({prompts})")
    responses = (mini or prompts) * cfg.rollout.n
    if responses % dp:
        raise ConfigError(f"train.prompts_per_step: {responses} responses per update cannot be split evenly "
                          f"across {dp} data-parallel ranks")
