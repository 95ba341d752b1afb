"""On-policy distillation: the policy samples, a frozen teacher scores every sampled token, and
the per-token reverse KL log pi(token) - log teacher(token) (a one-sample estimate of
KL(pi || teacher) at that position) is the signal: as each token's advantage, or as a penalty in
its reward before the advantage estimator (`algorithm.distill`)."""

from __future__ import annotations

import torch

from rlsys.algorithms.aggregation import masked


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
