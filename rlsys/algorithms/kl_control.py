"""KL to the reference policy as a penalty in the reward (VeRL's `use_kl_in_reward`),
with a fixed or adaptive coefficient.

Each response token's reward becomes score - beta x KL(token), KL estimated from
the policy's log-probs at sampling time and the reference's; the advantage
estimator then sees the penalty, unlike the KL loss (`algorithm.kl_coef`), which
only enters the gradient. The adaptive controller (Ziegler et al. 2019) moves beta
toward `target_kl`: by a factor 1 + e x samples / horizon per step, the error e
being current_kl / target_kl - 1 clipped to +-0.2.
"""

from __future__ import annotations

import torch

from rlsys.algorithms.policy_loss import kl_penalty, masked
from rlsys.config.schema import KLControlConfig


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
