"""The `#### answer` check of verl.utils.reward_score.gsm8k, strict method."""

import re


def compute_score(solution_str: str, ground_truth: str) -> float:
    found = re.findall(r"#### (\-?[0-9\.\,]+)", solution_str)
    return 1.0 if found and found[-1].replace(",", "") == str(ground_truth) else 0.0
