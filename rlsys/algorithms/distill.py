"""On-policy distillation: the policy samples, a frozen teacher scores every sampled token, and
the per-token reverse KL log pi(token) - log teacher(token) (a one-sample estimate of
KL(pi || teacher) at that position) is the signal: as each token's advantage, or as a penalty in
its reward before the advantage estimator (`algorithm.distill`). With `top_k`, the teacher also
gives its k most likely tokens at each position, and the loss takes the KL from the teacher to
the policy over them (`top_k_forward_kl`): every position then says which tokens to prefer, not
only whether the sampled one was likely."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlsys.algorithms.aggregation import masked

TOP_IDS = "teacher_top_ids"
"""Batch field: [B, T, k] the teacher's k most likely tokens at each input position (as
log-probs are aligned: column t is the distribution over token t given the tokens before it)."""
TOP_LOGPROBS = "teacher_top_logprobs"
"""Batch field: [B, T, k] the teacher's log-probs of TOP_IDS."""


@dataclass
class TeacherTokens:
    """A teacher's log-probs over one response: of each token the policy sampled, and with top-k of
    its k most likely tokens at each response position (empty without)."""

    sampled: list[float]
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)


def reverse_kl(logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """[B, T] log-probs of the sampled tokens under the policy that sampled them and under the
    teacher, and the response-token mask: the per-token reverse KL (0 off the mask) and its metrics,
    token means over the batch."""
    kl = masked(logprobs - teacher_logprobs, mask)
    tokens = mask.sum().clamp(min=1)
    return kl, {"distill/reverse_kl": (kl.sum() / tokens).item(),
                "distill/teacher_logprob_mean": (masked(teacher_logprobs, mask).sum() / tokens).item(),
                "distill/policy_logprob_mean": (masked(logprobs, mask).sum() / tokens).item()}


def top_k_forward_kl(policy_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """[..., k] the policy's and the teacher's log-probs of the teacher's k most likely tokens: per
    position, sum_j p_teacher(j) (log p_teacher(j) - log p_policy(j)), the KL from the teacher to
    the policy truncated to the teacher's top k (neither renormalised, as VeRL's
    compute_forward_kl_topk). Its gradient raises each of the k tokens by its teacher probability."""
    return (teacher_logprobs.exp() * (teacher_logprobs - policy_logprobs)).sum(-1)


def top_k_fields(per_sample: list[TeacherTokens], batch_shape: tuple[int, int], starts: list[int], k: int
                 ) -> dict[str, torch.Tensor]:
    """The batch's TOP_IDS and TOP_LOGPROBS from each row's TeacherTokens, whose response starts at
    input position `starts[row]` (zeros elsewhere: off the loss mask)."""
    ids = torch.zeros(*batch_shape, k, dtype=torch.long)
    logprobs = torch.zeros(*batch_shape, k, dtype=torch.float32)
    for row, (tokens, start) in enumerate(zip(per_sample, starts)):
        end = start + len(tokens.top_ids)
        ids[row, start:end] = torch.tensor(tokens.top_ids, dtype=torch.long).view(-1, k)
        logprobs[row, start:end] = torch.tensor(tokens.top_logprobs, dtype=torch.float32).view(-1, k)
    return {TOP_IDS: ids, TOP_LOGPROBS: logprobs}
