"""Reward registry.

A reward has VeRL's signature, so VeRL reward functions register unchanged:
`fn(data_source, solution_str, ground_truth, extra_info=None) -> float | dict`
(a dict carries the score under "score").
"""

from __future__ import annotations

from typing import Any, Callable

RewardFn = Callable[..., Any]
_REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def add(fn: RewardFn) -> RewardFn:
        if name in _REWARDS and _REWARDS[name] is not fn:
            raise ValueError(f"reward {name!r} is already registered")
        _REWARDS[name] = fn
        return fn

    return add


def get_reward(name: str) -> RewardFn:
    try:
        return _REWARDS[name]
    except KeyError:
        raise KeyError(f"unknown reward {name!r}; registered: {', '.join(sorted(_REWARDS))}") from None


def registered_rewards() -> list[str]:
    return sorted(_REWARDS)


def score_of(result: Any) -> float:
    return float(result["score"] if isinstance(result, dict) else result)
