"""Reward registry.

A reward has VeRL's signature, so VeRL reward functions register unchanged:
`fn(data_source, solution_str, ground_truth, extra_info=None) -> float | dict`
(a dict carries the score under "score").
"""

from __future__ import annotations

from typing import Any, Callable

from rlsys.registry import Registry

RewardFn = Callable[..., Any]
REWARDS: Registry[RewardFn] = Registry("reward")


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    return lambda fn: REWARDS.register(name, fn)


def get_reward(name: str) -> RewardFn:
    return REWARDS[name]


def registered_rewards() -> list[str]:
    return REWARDS.names()


def score_of(result: Any) -> float:
    return float(result["score"] if isinstance(result, dict) else result)
