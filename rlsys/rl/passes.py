"""The trainer's forward passes of a step before its update, as the job's extensions declare them: the
sampling policy's log-probs (old), with what the same pass can give (the experts it routed to, sums of
squared probabilities), the engine's as a field, and the reference's."""

from __future__ import annotations

from typing import Literal

import torch

from rlsys.actors.phases import PhaseTimer
from rlsys.algorithms.lm_loss import LossFn, logprobs_and_sum_pi_squared, token_logprobs
from rlsys.config.schema import RLJobConfig
from rlsys.data.batching import Batch, on_response_tokens
from rlsys.parallel.router_replay import ROUTING_FIELD
from rlsys.rl.batch import RLBatch
from rlsys.rl.features import features_of
from rlsys.rl.update import updates_per_step

OldLogprobs = Literal["current", "trainer", "rollout"]


def old_logprobs_source(cfg: RLJobConfig, needs: frozenset[str] | None = None) -> OldLogprobs:
    """Where the update's old log-probs come from: the engine's in bypass mode. `auto`: the update's own
    forward when the update is on-policy (one update a step, synchronous, no extension reading them
    before the update), else a trainer forward pass before the update. `needs`: the job's features'
    (`Features.needs`), when they are built already."""
    algo = cfg.algorithm
    if algo.rollout_correction.bypass_mode:
        return "rollout"
    if algo.old_logprobs != "auto":
        return algo.old_logprobs
    read_before = "old_logprobs" in (features_of(cfg).needs if needs is None else needs)
    on_policy = updates_per_step(cfg) == 1 and not read_before and cfg.train.async_mode == "off"
    return "current" if on_policy else "trainer"


def needs_reference(cfg: RLJobConfig) -> bool:
    """A KL term, in the loss or in the reward, reads a frozen reference policy."""
    return "ref_logprobs" in features_of(cfg).needs


class LogprobPasses:
    def __init__(self, train_group, cfg: RLJobConfig, needs: frozenset[str]):
        self.train_group, self.needs = train_group, needs
        self.source = old_logprobs_source(cfg, needs)
        self.temperature = cfg.rollout.temperature

    def run(self, batch: RLBatch, timer: PhaseTimer) -> dict[str, float]:
        """Fill the fields the update and the extensions read. With R3 and a trainer pass, returns how often
        its routers chose the engine's experts (`router/engine_agreement`: the trainer on the weights that
        sampled)."""
        metrics = {}
        if self.source == "trainer":
            with timer("old_logprob"):
                metrics = self._old_logprobs(batch)
        elif self.source == "rollout":
            batch.old_logprobs = on_response_tokens(batch.engine_logprobs, batch.rows)
        if "rollout_logprobs" in self.needs:
            batch.rollout_logprobs = on_response_tokens(batch.engine_logprobs, batch.rows)
        if "ref_logprobs" in self.needs:
            with timer("reference"):
                batch.ref_logprobs, _ = self.policy(batch.for_workers(), reference=True)
        return metrics

    def _old_logprobs(self, batch: RLBatch) -> dict[str, float]:
        """The old log-probs from the policy's pass, with what the step needs of the same pass: the experts
        each token went to (R2), or the sums of squared probabilities (the optimal token baselines)."""
        if "routing" in self.needs:
            rows = self.rows(batch.for_workers(), token_logprobs(self.temperature), record_routing=True)
            batch.old_logprobs, batch.routing = rows["logprobs"], rows[ROUTING_FIELD]
            return {}
        if "sum_pi_squared" in self.needs:
            rows = self.rows(batch.for_workers(), logprobs_and_sum_pi_squared(self.temperature))
            batch.old_logprobs, batch.sum_pi_squared = rows["logprobs"], rows["sum_pi_squared"]
            return {}
        batch.old_logprobs, pass_metrics = self.policy(batch.for_workers())
        if "router/replay_agreement" in pass_metrics:  # R3: the batch carries the engine's experts
            return {"router/engine_agreement": pass_metrics["router/replay_agreement"]}
        return {}

    def rows(self, rows: Batch, loss_fn: LossFn, record_routing: bool = False) -> dict[str, torch.Tensor]:
        """The policy's pass of `loss_fn` over the rows: its outputs by name."""
        return self.train_group.forward(rows, loss_fn, record_routing=record_routing)[0]

    def policy(self, rows: Batch, reference: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
        """The rows' log-probs from the policy (or the reference), and the pass's metrics."""
        out, metrics = self.train_group.forward(rows, token_logprobs(self.temperature),
                                                role="reference" if reference else "policy")
        return out["logprobs"], metrics
