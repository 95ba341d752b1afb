"""Built-in verifiers."""

from __future__ import annotations

from rlsys.rewards.registry import register_reward
from rlsys.tasks import arith


@register_reward("arith")
def arith_exact(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """1.0 when the response is exactly the problem's integer answer."""
    return 1.0 if arith.is_correct(solution_str, ground_truth) else 0.0
