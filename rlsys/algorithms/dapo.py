"""DAPO's two changes to what a step trains on (Yu et al. 2025, VeRL's `filter_groups`
and `overlong_buffer`).

Dynamic sampling: a group whose responses all scored the same has zero advantage
under a group baseline and only dilutes the batch, so the driver keeps drawing
prompts until the batch holds `train.prompts_per_step` groups of mixed scores.

Overlong shaping: a response that runs into the last `overlong_buffer_len` tokens
of the budget loses up to `overlong_penalty_factor`, linearly in how far it ran in.
"""

from __future__ import annotations

import torch


def mixed_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """[groups] True where the group's scores are not all equal (rows are n per group, in order)."""
    by_group = scores.view(-1, group_size)
    return (by_group != by_group[:, :1]).any(dim=1)


def overlong_penalty(response_lengths: torch.Tensor, max_new_tokens: int, buffer_len: int,
                     factor: float) -> torch.Tensor:
    """Per response: 0 up to max_new_tokens - buffer_len tokens, then falling linearly to
    -factor at max_new_tokens."""
    exceed = response_lengths.float() - (max_new_tokens - buffer_len)
    return (-exceed / buffer_len * factor).clamp(max=0.0)
