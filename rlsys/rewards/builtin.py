"""Built-in verifiers, all with VeRL's reward signature. (The example tasks in `rlsys/tasks/`
register their own: `arith`, `calc`.)"""

from __future__ import annotations

import re

from rlsys.rewards.registry import register_reward

_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


@register_reward("exact_match")
def exact_match(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """1.0 when the stripped response equals the stripped ground truth."""
    return float(solution_str.strip() == str(ground_truth).strip())


@register_reward("gsm8k")
def gsm8k(data_source, solution_str, ground_truth, extra_info=None, format_score: float = 0.0) -> float:
    """GSM8K style: the last `#### <number>` in the response against the ground truth."""
    found = _GSM8K_ANSWER.findall(solution_str)
    if not found:
        return 0.0
    answer = found[-1].replace(",", "").rstrip(".")
    return 1.0 if answer == str(ground_truth).replace(",", "").strip() else format_score


@register_reward("math_verify")
def math_verify(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """Mathematical equivalence of the response's final answer and the ground truth (math-verify)."""
    from math_verify import parse, verify

    gold = parse(f"${ground_truth}$" if "$" not in str(ground_truth) else str(ground_truth))
    return 1.0 if verify(gold, parse(solution_str)) else 0.0


@register_reward("regex_format")
def regex_format(data_source, solution_str, ground_truth, extra_info=None, pattern: str = r".+") -> float:
    """1.0 when the whole stripped response matches `pattern`."""
    return float(re.fullmatch(pattern, solution_str.strip(), flags=re.S) is not None)
