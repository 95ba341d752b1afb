"""On-policy distillation (`algorithm.distill`): a frozen teacher scores every sampled token; the
per-token reverse KL to it is a penalty in the reward or a term of the advantage, and with top-k the
teacher's most likely tokens join the batch for the loss (`rlsys.algorithms.distill`)."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from rlsys.actors.phases import PhaseTimer
from rlsys.actors.served_models import ServedModelWorker
from rlsys.algorithms.distill import TOP_IDS, TOP_LOGPROBS, reverse_kl, top_k_fields
from rlsys.algorithms.lm_loss import token_logprobs, top_k_logprobs
from rlsys.config.loader import ConfigError
from rlsys.config.model import ModelConfig
from rlsys.config.rl import DistillConfig
from rlsys.config.schema import RLJobConfig
from rlsys.data.batching import on_response_tokens
from rlsys.data.tokenizer import load_tokenizer
from rlsys.models.directory import check_model_dir
from rlsys.parallel.parallelize import check_layout
from rlsys.rl.batch import RLBatch
from rlsys.rl.extension import StepExtension, StepGroups


class Distillation(StepExtension):
    def __init__(self, cfg: DistillConfig):
        self.cfg = cfg
        self.calls: list | None = None
        """The teacher engines' requests for this step (None: the training group holds the teacher)."""
        self.kl: torch.Tensor | None = None
        """[B, T] this step's reverse KL to the teacher of each sampled token."""

    @classmethod
    def check(cls, job: RLJobConfig, model: PretrainedConfig) -> None:
        """The teacher reads the policy's token ids; in the training group it fits the policy's layout."""
        distill = job.algorithm.distill
        if distill is None:
            return
        teacher = check_teacher(distill.teacher, job.model.path)
        if distill.source == "trainer":
            try:
                check_layout(job.parallel, teacher)
            except ConfigError as err:
                raise ConfigError(f"algorithm.distill.source: trainer puts the teacher in the policy's layout, "
                                  f"which it does not fit: {err}") from None

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


def check_teacher(teacher: str, policy: str) -> PretrainedConfig:
    """The distillation teacher: a causal LM whose tokenizer is the policy's (its log-probs are of
    the policy's token ids). Returns its config."""
    key = "algorithm.distill.teacher"
    config = check_model_dir(ModelConfig(path=teacher), key)
    kind = (getattr(config, "architectures", None) or ["?"])[0]
    if not kind.endswith("ForCausalLM"):
        raise ConfigError(f"{key}: the teacher must be a causal LM; {teacher} is {kind}")
    ours, theirs = load_tokenizer(policy, "model.path").get_vocab(), load_tokenizer(teacher, key).get_vocab()
    if ours != theirs:
        differ = sum(ours.get(token) != index for token, index in theirs.items()) + len(ours.keys() - theirs.keys())
        raise ConfigError(f"{key}: its tokenizer differs from model.path's ({len(theirs)} vs {len(ours)} tokens, "
                          f"{differ} mapped differently); distillation compares log-probs of the same token ids")
    return config
