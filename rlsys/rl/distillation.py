"""On-policy distillation (`algorithm.distill`): a frozen teacher scores every sampled token; the
per-token reverse KL to it is a penalty in the reward or a term of the advantage, and with top-k the
teacher's most likely tokens join the batch for the loss (`rlsys.algorithms.distill`)."""

from __future__ import annotations

import torch

from rlsys.actors.phases import PhaseTimer
from rlsys.actors.served_models import ServedModelWorker
from rlsys.algorithms.distill import TOP_IDS, TOP_LOGPROBS, reverse_kl, top_k_fields
from rlsys.algorithms.lm_loss import token_logprobs, top_k_logprobs
from rlsys.config.rl import DistillConfig
from rlsys.data.batching import on_response_tokens
from rlsys.rl.batch import RLBatch
from rlsys.rl.extension import StepExtension, StepGroups


class Distillation(StepExtension):
    def __init__(self, cfg: DistillConfig):
        self.cfg = cfg
        self.calls: list | None = None
        """The teacher engines' requests for this step (None: the training group holds the teacher)."""
        self.kl: torch.Tensor | None = None
        """[B, T] this step's reverse KL to the teacher of each sampled token."""

    def add_inputs(self, batch: RLBatch, groups: StepGroups) -> None:
        """Ask the teacher's engines (while the trainer's passes run) for their log-prob of every response
        token, and with top-k their most likely tokens."""
        if groups.teacher is not None:
            sequences = [(s.prompt_ids + s.response_ids, len(s.prompt_ids)) for s in batch.segments]
            self.calls = groups.teacher.submit_split(ServedModelWorker.token_logprobs, sequences, self.cfg.top_k)

    def shape_rewards(self, batch: RLBatch, groups: StepGroups, timer: PhaseTimer) -> dict[str, float]:
        """The reverse KL, taken against the engine's log-probs (the policy that drew the tokens), as a
        penalty on the token rewards in `penalty` mode; its metrics."""
        with timer("teacher"):
            teacher_logprobs = self._teacher_logprobs(batch, groups)
        self.kl, metrics = reverse_kl(on_response_tokens(batch.engine_logprobs, batch.rows), teacher_logprobs,
                                      batch.loss_mask)
        if self.cfg.mode == "penalty":
            batch.token_rewards = batch.token_rewards - self.cfg.coef * self.kl
        return metrics

    def adjust_advantages(self, batch: RLBatch) -> None:
        """`advantage` mode without top-k: the reverse KL is a term of each token's advantage."""
        if self.cfg.mode == "advantage" and not self.cfg.top_k:
            batch.advantages = batch.advantages - self.cfg.coef * self.kl

    def _teacher_logprobs(self, batch: RLBatch, groups: StepGroups) -> torch.Tensor:
        """The teacher's log-probs of the sampled tokens, [B, T]: from its engines, or a forward pass of its
        copy in the training group; with top-k, its top tokens and their log-probs go into the batch."""
        top_k = self.cfg.top_k
        if self.calls is None:
            loss_fn = top_k_logprobs(top_k) if top_k else token_logprobs(1.0)  # the teacher's own distribution
            rows, _ = groups.train.forward(batch.for_workers(), loss_fn, role="teacher")
            if top_k:
                batch.teacher_top_ids, batch.teacher_top_logprobs = rows["top_ids"], rows["top_logprobs"]
            return rows["logprobs"]
        per_sample, self.calls = groups.teacher.gather(self.calls), None
        if top_k:
            fields = top_k_fields(per_sample, tuple(batch.rows["input_ids"].shape),
                                  [len(s.prompt_ids) for s in batch.segments], top_k)
            batch.teacher_top_ids, batch.teacher_top_logprobs = fields[TOP_IDS], fields[TOP_LOGPROBS]
        sampled = [lp for s, tokens in zip(batch.segments, per_sample)
                   for lp, kept in zip(tokens.sampled, s.response_mask) if kept]
        return on_response_tokens(torch.tensor(sampled), batch.rows)
