"""GRPO advantages: each response's reward relative to its prompt's group."""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """(r - mean of the group) / (std of the group + eps); without std
    normalisation (Dr. GRPO) just r - mean. A group of one gets 0. The std is
    the unbiased one, as VeRL computes it."""
    advantages = torch.zeros_like(rewards, dtype=torch.float32)
    for group in group_ids.unique():
        members = group_ids == group
        scores = rewards[members].float()
        if scores.numel() < 2:
            continue
        centred = scores - scores.mean()
        advantages[members] = centred / (scores.std() + eps) if norm_by_std else centred
    return advantages
