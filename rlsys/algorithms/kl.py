"""KL to the reference policy: the per-token estimators (for the KL loss, `algorithm.kl_coef`)
and the penalty in the reward (VeRL's `use_kl_in_reward`) with a fixed or adaptive coefficient.

In the reward, each response token's reward becomes score - beta x KL(token), KL estimated from
the policy's log-probs at sampling time and the reference's; the advantage
estimator then sees the penalty, unlike the KL loss (`algorithm.kl_coef`), which
only enters the gradient. The adaptive controller (Ziegler et al. 2019) moves beta
toward `target_kl`: by a factor 1 + e x samples / horizon per step, the error e
being current_kl / target_kl - 1 clipped to +-0.2.
"""

from __future__ import annotations

import torch

from rlsys.algorithms.aggregation import masked
from rlsys.config.rl import KLControlConfig

LOG_RATIO_LIMIT = 20.0
"""VeRL clamps log-ratios to +-20 before `exp`."""

KL_ESTIMATORS = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3", "abs": "abs"}
"""Accepted names (VeRL's included) -> the estimator."""


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy.

    k1 (VeRL: kl) = log(p/q); abs = |log(p/q)|; k2 (mse) = log(p/q)^2 / 2;
    k3 (low_var_kl) = q/p - 1 - log(q/p), non-negative and unbiased, with VeRL's
    clamps: log(q/p) to +-20, the estimate to [-10, 10].
    """
    log_ratio = logprobs - ref_logprobs
    kind = KL_ESTIMATORS.get(estimator)
    if kind == "k1":
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        reverse = (-log_ratio).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        return (torch.exp(reverse) - reverse - 1).clamp(-10, 10)
    raise ValueError(f"unknown KL estimator {estimator!r}")


class KLController:
    def __init__(self, cfg: KLControlConfig):
        self.cfg, self.value = cfg, cfg.kl_coef

    def update(self, current_kl: float, samples: int) -> None:
        if self.cfg.type == "adaptive":
            error = min(max(current_kl / self.cfg.target_kl - 1, -0.2), 0.2)
            self.value *= 1 + error * samples / self.cfg.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def kl_in_reward(token_rewards: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                 mask: torch.Tensor, estimator: str, controller: KLController
                 ) -> tuple[torch.Tensor, dict[str, float]]:
    """[B, T] tensors aligned with input_ids; `mask` is 1 on response tokens. Returns the
    penalised token rewards and the batch's KL (mean over each response, then over
    responses) with the coefficient it was penalised with; then updates the controller."""
    kl = masked(kl_penalty(logprobs, masked(ref_logprobs, mask, logprobs), estimator), mask)
    beta = controller.value
    current_kl = (kl.sum(-1) / mask.sum(-1).clamp(min=1)).mean().item()
    controller.update(current_kl, len(token_rewards))
    return token_rewards - beta * kl, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
