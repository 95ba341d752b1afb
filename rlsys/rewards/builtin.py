"""Built-in verifiers, all with VeRL's reward signature."""

from __future__ import annotations

import re

from rlsys.rewards.registry import register_reward
from rlsys.tasks import arith, calc

_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


@register_reward("arith")
def arith_exact(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """1.0 when the response is exactly the problem's integer answer."""
    return 1.0 if arith.is_correct(solution_str, ground_truth) else 0.0


@register_reward("calc")
def calc_answer(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """1.0 when the final assistant turn (a multi-turn loop's `final_turn`, else the response) is
    exactly the integer answer."""
    final = extra_info.get("final_turn", solution_str) if isinstance(extra_info, dict) else solution_str
    return 1.0 if calc.is_correct(final, ground_truth) else 0.0


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
