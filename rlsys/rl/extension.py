"""A feature of the RL step, as an extension: it declares the fields of the trainer's passes it reads
before the update (`needs`), and hooks the phases it changes. The step runs every hook of every
extension of the job, in the order `rlsys.rl.features.features_of` gives, so a feature lives in one module.

Adding one: subclass `StepExtension` in a module of its own (its config section is its constructor's
argument), override the hooks it needs, and add it to `rlsys.rl.features.features_of`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig

from rlsys.actors.phases import PhaseTimer
from rlsys.agents.trajectory import Trajectory
from rlsys.config.schema import RLJobConfig
from rlsys.data.batching import Batch
from rlsys.rl.batch import RLBatch, Rollout

PASS_FIELDS = ("old_logprobs", "ref_logprobs", "rollout_logprobs", "sum_pi_squared", "routing")
"""What an extension may need from the trainer's passes before the update: the sampling policy's log-probs
(an extension that needs them makes the update off-policy by one pass), the reference's, the engine's
as a [B, T] field, the old pass's sums of squared probabilities, or the experts its routers chose."""


@dataclass
class StepGroups:
    """The actors a step's phases call."""

    train: Any
    """`TrainGroup`: the policy's ranks, with the reference, critic or teacher they hold."""
    rollout: Any
    """`RolloutGroup`: the engines that sample."""
    rewards: Any
    """`RewardPool`: the reward terms."""
    teacher: Any = None
    """`ServedModelGroup`: a distillation teacher's own engines (None: none, or in the training group)."""
    prompts: list | None = None
    """The training prompts (`rlsys.data.rl.Prompt`), by index."""


class StepExtension:
    """A feature of the step; every hook does nothing unless overridden."""

    needs: frozenset[str] = frozenset()
    """The PASS_FIELDS it reads before the update."""
    draws: int = 1
    """How many prompt draws a step may take to fill its batch with the groups `keep_groups` keeps."""

    @classmethod
    def check(cls, job: RLJobConfig, model: PretrainedConfig) -> None:
        """Before Ray starts: the feature's rules on the rest of the job (`model`: the policy's config), a
        ConfigError naming the key; nothing when the job does not turn the feature on."""

    def rollout_rewards(self, samples: list[Trajectory], rewards: torch.Tensor) -> torch.Tensor:
        """A draw's reward per sample, from its score: shaped (a length penalty)."""
        return rewards

    def keep_groups(self, scores: torch.Tensor, n: int) -> torch.Tensor | None:
        """Which of a draw's prompt groups (`n` samples each, in order) the step trains on first; None: all."""
        return None

    def rollout_metrics(self, rollout: Rollout, draws: int, kept_groups: int) -> dict[str, float]:
        """The rollout's metrics of the feature: after `draws` draws, `kept_groups` groups were kept."""
        return {}

    def on_draw(self, prompts: list[tuple], seed: int, step: int, groups: StepGroups) -> None:
        """After the engines sampled a prompt draw (synchronous rollouts): `prompts` as (index, ids, row)."""

    def add_inputs(self, batch: RLBatch, groups: StepGroups) -> None:
        """Once the rows exist, before the trainer's passes: inputs of its own, requests to its models."""

    def shape_rewards(self, batch: RLBatch, groups: StepGroups, timer: PhaseTimer) -> dict[str, float]:
        """After the passes: change batch.token_rewards (a penalty per token); returns metrics."""
        return {}

    def advantage_inputs(self, batch: RLBatch, groups: StepGroups, timer: PhaseTimer) -> None:
        """Before the advantage estimator: the batch fields it reads that this feature makes."""

    def adjust_advantages(self, batch: RLBatch) -> None:
        """After the estimator: change batch.advantages, or make what the update reads beside them."""

    def loss_counts(self, batch: RLBatch) -> tuple[dict[str, float], dict[str, float]]:
        """Once an update: what each mini-batch's loss divides by beyond tokens and sequences, and metrics."""
        return {}, {}

    def trains_actor(self, step: int) -> bool:
        """Whether step `step` updates the policy."""
        return True

    def before_actor_step(self, mini: Batch, counts: dict[str, float], groups: StepGroups) -> dict[str, float]:
        """Each mini-batch of the update, before the policy's step: another model's step; returns its metrics."""
        return {}

    def state(self) -> dict[str, Any]:
        """Driver-side objects (state_dict / load_state_dict) the checkpoints keep, by name."""
        return {}
