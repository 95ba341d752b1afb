"""The trainer's forward passes of an RL step before its update: the log-prob fields the update
and the advantage estimator read, from the policy (old log-probs) and the reference."""

from __future__ import annotations

import torch

from rlsys.actors.phases import PhaseTimer
from rlsys.algorithms.rollout_correction import rollout_is_weights
from rlsys.config.schema import RLJobConfig
from rlsys.data.batching import Batch, on_response_tokens
from rlsys.parallel.router_replay import ROUTING_FIELD
from rlsys.stages.rl_update import needs_reference, needs_sum_pi_squared, old_logprobs_source

SUM_PI_SQUARED = "sum_pi_squared"


class LogprobPasses:
    def __init__(self, train_group, cfg: RLJobConfig):
        self.train_group, self.cfg = train_group, cfg
        self.source = old_logprobs_source(cfg)
        self.temperature = cfg.rollout.temperature

    def add(self, batch: Batch, engine_logprobs: torch.Tensor, timer: PhaseTimer) -> dict[str, float]:
        """The log-prob fields the update reads: old (a trainer pass, or the engine's), the
        engine's for rollout importance sampling, the reference's for a KL term, and for the
        optimal token baselines each position's sum of squared probabilities from the old pass.
        With R3 and a trainer pass, returns how often its routers chose the engine's experts
        (`router/engine_agreement`: the trainer on the weights that sampled)."""
        algo, metrics = self.cfg.algorithm, {}
        if self.source == "trainer":
            with timer("old_logprob"):
                metrics = self._old_logprobs(batch)
        elif self.source == "rollout":
            batch["old_logprobs"] = on_response_tokens(engine_logprobs, batch)
        if algo.rollout_correction.active:
            batch["rollout_logprobs"] = on_response_tokens(engine_logprobs, batch)
        if needs_reference(algo):
            with timer("reference"):
                batch["ref_logprobs"], _ = self.policy(batch, reference=True)
        return metrics

    def _old_logprobs(self, batch: Batch) -> dict[str, float]:
        """The old log-probs from the policy's pass, with what the step needs of the same pass:
        the experts each token went to (R2), or the sums of squared probabilities (OTB)."""
        if self.cfg.algorithm.router_replay == "r2":
            rows = self._rows("compute_logprobs_and_routing", batch)
            batch["old_logprobs"], batch[ROUTING_FIELD] = rows["logprobs"], rows[ROUTING_FIELD]
            return {}
        if needs_sum_pi_squared(self.cfg.algorithm):
            rows = self._rows("compute_logprobs_and_sum_pi_squared", batch)
            batch["old_logprobs"], batch[SUM_PI_SQUARED] = rows["logprobs"], rows[SUM_PI_SQUARED]
            return {}
        batch["old_logprobs"], pass_metrics = self.policy(batch)
        if "router/replay_agreement" in pass_metrics:  # R3: the batch carries the engine's experts
            return {"router/engine_agreement": pass_metrics["router/replay_agreement"]}
        return {}

    def _rows(self, method: str, batch: Batch) -> dict[str, torch.Tensor]:
        shards = self.train_group.run_data_parallel(method, batch, temperature=self.temperature)
        return {name: torch.cat([rows[name] for rows in shards]) for name in shards[0]}

    def policy(self, batch: Batch, reference: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
        """The batch's log-probs from the policy (or the reference), and the pass's metrics."""
        shards = self.train_group.run_data_parallel("compute_logprobs", batch, temperature=self.temperature,
                                                    reference=reference)
        return torch.cat([logprobs for logprobs, _ in shards]), shards[0][1]


def is_weights(cfg: RLJobConfig, batch: Batch) -> torch.Tensor | None:
    """[B, T] the truncated rollout importance weights of the old policy against the engine's, for
    the optimal token baselines, which weight by them, when `rollout_correction.rollout_is` is on."""
    correction = cfg.algorithm.rollout_correction
    if not needs_sum_pi_squared(cfg.algorithm) or correction.rollout_is == "none" or "rollout_logprobs" not in batch:
        return None
    return rollout_is_weights(batch["old_logprobs"], batch["rollout_logprobs"], batch["loss_mask"], correction)
