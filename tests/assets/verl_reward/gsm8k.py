"""A GSM8K scorer in the shape of VeRL's `utils/reward_score/gsm8k.py`: the answer after '####'."""

import re


def extract_solution(solution_str, method="strict"):
    if method == "strict":
        found = re.findall(r"#### (\-?[0-9\.\,]+)", solution_str)
        return found[-1].replace(",", "").replace("$", "") if found else None
    numbers = re.findall(r"(\-?[0-9\.\,]+)", solution_str)
    return next((n for n in reversed(numbers) if n not in ("", ".")), None)


def compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0
    return score if answer == ground_truth else format_score
