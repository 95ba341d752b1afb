"""How an RL step's update is laid out, derived from the job's config: its mini-batches, where the
old log-probs of the PPO ratio come from, and whether a frozen reference policy is needed."""

from __future__ import annotations

from typing import Literal

from rlsys.config.rl import AlgorithmConfig
from rlsys.config.schema import RLJobConfig


def mini_batches_per_step(cfg: RLJobConfig) -> int:
    """Policy updates per epoch: mini-batches of `algorithm.ppo_mini_batch_size` prompts (0: one)."""
    mini = cfg.algorithm.ppo_mini_batch_size
    return cfg.train.prompts_per_step // mini if mini else 1


def updates_per_step(cfg: RLJobConfig) -> int:
    return cfg.algorithm.ppo_epochs * mini_batches_per_step(cfg)


def old_logprobs_source(cfg: RLJobConfig) -> Literal["current", "trainer", "rollout"]:
    """Where the update's old log-probs come from. `auto`: the update's own forward when the
    update is on-policy (one update a step, synchronous, no KL in the reward, which needs the
    sampling policy's log-probs first, no R2 routing replay, which records the routing in that
    pass), else a trainer forward pass before the update."""
    algo = cfg.algorithm
    if algo.old_logprobs != "auto":
        return algo.old_logprobs
    on_policy = (updates_per_step(cfg) == 1 and not algo.use_kl_in_reward and algo.router_replay != "r2"
                 and cfg.train.async_mode == "off")  # asynchronous: older weights sampled
    return "current" if on_policy else "trainer"


def needs_reference(algo: AlgorithmConfig) -> bool:
    """A KL term, in the loss or in the reward, reads a frozen reference policy."""
    return algo.kl_coef > 0 or algo.use_kl_in_reward
