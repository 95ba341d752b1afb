"""The learning-rate schedule: linear warm-up, then cosine decay, and how a restored schedule
takes this run's peak."""

from __future__ import annotations

import math

import torch


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to min_ratio at total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def follow_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, lr: float) -> None:
    """Set a restored scheduler's optimizer to this run's schedule (peak `lr`) at the restored
    step. The checkpoint holds the saved run's lr, which its next step would still take when the
    schedule changed on resume (a larger `train.steps`, say); an unchanged one gives the same lr."""
    scheduler.base_lrs = [lr] * len(scheduler.optimizer.param_groups)
    lrs = [base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, group_lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = group_lr
    scheduler._last_lr = lrs
