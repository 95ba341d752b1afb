"""How an RL step's update is laid out, derived from the job's config: its mini-batches, where the
old log-probs of the PPO ratio come from, and whether a frozen reference policy is needed."""

from __future__ import annotations

from typing import Literal

from rlsys.algorithms.rollout_correction import is_weight_mean
from rlsys.config.rl import AlgorithmConfig
from rlsys.config.schema import RLJobConfig
from rlsys.data.batching import Batch, num_targets


def mini_batches_per_step(cfg: RLJobConfig) -> int:
    """Policy updates per epoch: mini-batches of `algorithm.ppo_mini_batch_size` prompts (0: one)."""
    mini = cfg.algorithm.ppo_mini_batch_size
    return cfg.train.prompts_per_step // mini if mini else 1


def updates_per_step(cfg: RLJobConfig) -> int:
    return cfg.algorithm.ppo_epochs * mini_batches_per_step(cfg)


def old_logprobs_source(cfg: RLJobConfig) -> Literal["current", "trainer", "rollout"]:
    """Where the update's old log-probs come from: the engine's in bypass mode. `auto`: the
    update's own forward when the update is on-policy (one update a step, synchronous, no KL in
    the reward, which needs the sampling policy's log-probs first, no R2 routing replay, which
    records the routing in that pass, no batch-normalised importance weights, whose mean the
    driver takes over the old log-probs, no optimal token baseline, which reads that pass), else a
    trainer forward pass before the update."""
    algo = cfg.algorithm
    if algo.rollout_correction.bypass_mode:
        return "rollout"
    if algo.old_logprobs != "auto":
        return algo.old_logprobs
    on_policy = (updates_per_step(cfg) == 1 and not algo.use_kl_in_reward and algo.router_replay != "r2"
                 and not needs_sum_pi_squared(algo)  # read from the same pass, before the advantages
                 and not algo.rollout_correction.rollout_is_batch_normalize  # a mean over the batch's old ones
                 and cfg.train.async_mode == "off")  # asynchronous: older weights sampled
    return "current" if on_policy else "trainer"


def needs_sum_pi_squared(algo: AlgorithmConfig) -> bool:
    """The optimal token baselines read each position's sum of squared probabilities."""
    return algo.adv_estimator in ("optimal_token_baseline", "tir_optimal_token_baseline")


def needs_reference(algo: AlgorithmConfig) -> bool:
    """A KL term, in the loss or in the reward, reads a frozen reference policy."""
    return algo.kl_coef > 0 or algo.use_kl_in_reward


def loss_counts(cfg: RLJobConfig, mini: Batch, weight_mean: float | None) -> dict[str, float]:
    """What a mini-batch's loss divides by, over every rank and micro-batch: its response
    "tokens" and "sequences", the "horizon" (the response budget), and with batch-normalised
    importance weights the batch's mean weight ("is_weight_mean")."""
    counts = {"tokens": num_targets(mini), "sequences": mini["input_ids"].shape[0],
              "horizon": cfg.rollout.response_budget}
    if weight_mean is not None:
        counts["is_weight_mean"] = weight_mean
    return counts


def batch_is_weight_mean(cfg: RLJobConfig, batch: Batch) -> float | None:
    """The mean truncated importance weight of the step's batch, when the weights are batch-normalised."""
    correction = cfg.algorithm.rollout_correction
    if not (correction.rollout_is_batch_normalize and correction.rollout_is != "none"):
        return None
    mask = batch["loss_mask"][:, 1:]
    mean = is_weight_mean(batch["old_logprobs"][:, 1:], batch["rollout_logprobs"][:, 1:], mask, correction)
    return mean if mean > 1e-8 else 1.0  # no weight to speak of: left as they are, as VeRL leaves them
