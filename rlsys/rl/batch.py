"""What a step's phases hand on: the rollout's episodes and rewards (`Rollout`), and the rows the trainer
reads with every field the phases add to them (`RLBatch`), each declared here."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlsys.agents.trajectory import Trajectory
from rlsys.algorithms.actor_loss import ActorInputs
from rlsys.algorithms.advantages import AdvantageInputs
from rlsys.algorithms.distill import TOP_IDS, TOP_LOGPROBS
from rlsys.data.batching import Batch
from rlsys.parallel.router_replay import ROUTING_FIELD
from rlsys.rewards.scoring import ScoredSample


@dataclass
class Rollout:
    """The rollout phase's result: the step's episodes (by prompt draw, in order; samples an agent loop
    dropped left out), each one's group (its prompt draw: VeRL's uid), scores, rewards (shaped), and
    the phase's metrics."""

    episodes: list[Trajectory]
    groups: torch.Tensor
    scored: list[ScoredSample]
    rewards: torch.Tensor
    metrics: dict[str, float]


WIRE_FIELDS = {"routing": ROUTING_FIELD, "old_logprobs": "old_logprobs", "rollout_logprobs": "rollout_logprobs",
               "ref_logprobs": "ref_logprobs", "teacher_top_ids": TOP_IDS, "teacher_top_logprobs": TOP_LOGPROBS,
               "values": "values", "returns": "returns", "advantages": "advantages"}
"""The fields the training ranks read, by their name in the batch the ranks receive."""


@dataclass
class RLBatch:
    """A step's rows: each an episode's segment, prompt and response, right-padded. The [B, T] fields
    are aligned with input_ids (a log-prob at column t is token t's); a field is None until the phase
    or extension that makes it has run, and stays None when no feature of the job makes it."""

    rollout: Rollout
    segments: list[Trajectory]
    """Each row's trajectory: an episode, or one segment of a multi-segment episode."""
    episode_of: torch.Tensor
    """[N] each row's episode (an index into rollout.episodes), its rows consecutive."""
    rows: Batch
    """The model's inputs: input_ids, attention_mask, loss_mask (1 on sampled response tokens), and a
    vision-language prompt's pixels."""
    engine_logprobs: torch.Tensor
    """The engine's log-prob of every sampled token, the rows' response tokens back to back."""
    routing: torch.Tensor | None = None
    """[B, T, MoE layers, k] the experts each token goes to in the update: the engine's (R3), or the old pass's (R2)."""
    old_logprobs: torch.Tensor | None = None
    """The sampling policy's log-probs: a trainer pass, or the engine's (None: the update's own, on-policy)."""
    rollout_logprobs: torch.Tensor | None = None
    """The engine's log-probs, [B, T], for the rollout corrections."""
    ref_logprobs: torch.Tensor | None = None
    """The frozen reference policy's, for a KL term."""
    sum_pi_squared: torch.Tensor | None = None
    """Each position's sum of squared next-token probabilities, from the old pass (the optimal token baselines)."""
    is_weights: torch.Tensor | None = None
    """The truncated rollout importance weights the optimal token baselines weight by."""
    teacher_top_ids: torch.Tensor | None = None
    """[B, T, k] a teacher's k most likely tokens at each position (top-k distillation)."""
    teacher_top_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    """The critic's value of the state before each token."""
    reward_baselines: torch.Tensor | None = None
    """[B] the score of a greedy response to each row's prompt (ReMax)."""
    token_rewards: torch.Tensor | None = None
    """The rewards per token: each episode's on its last response token, less any per-token penalty."""
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    """What the critic regresses on."""
    sampler_logprobs: torch.Tensor | None = field(default=None, repr=False)
    """The trainer's log-probs of the policy that sampled the rows, for the mismatch metrics: the old pass's, or
    the update's first mini-batch's before any optimizer step."""

    @property
    def loss_mask(self) -> torch.Tensor:
        return self.rows["loss_mask"]

    def advantage_inputs(self) -> AdvantageInputs:
        """What the advantage estimator reads, one row per segment, grouped by prompt draw."""
        return AdvantageInputs(self.token_rewards, self.loss_mask, self.rollout.groups[self.episode_of], self.values,
                               self.old_logprobs, self.sum_pi_squared, self.is_weights, self.reward_baselines)

    def actor_inputs(self) -> ActorInputs:
        """The optional fields of the actor's loss the phases have made."""
        made = lambda value: value is not None  # noqa: E731
        return ActorInputs(old_logprobs=made(self.old_logprobs), rollout_logprobs=made(self.rollout_logprobs),
                           ref_logprobs=made(self.ref_logprobs), teacher_top_k=made(self.teacher_top_ids))

    def for_workers(self) -> Batch:
        """The rows and every field made so far that the training ranks read, under the names they read."""
        fields = {name: getattr(self, attr) for attr, name in WIRE_FIELDS.items()}
        return {**self.rows, **{name: value for name, value in fields.items() if value is not None}}
