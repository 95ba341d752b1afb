"""Checks that its ground truth arrives as stored: extra_info holds the ground truth's JSON and type name."""

import json


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    same_value = json.dumps(ground_truth, sort_keys=True) == extra_info["stored"]
    return float(same_value and type(ground_truth).__name__ == extra_info["type"])


def by_keyword(solution_str, ground_truth):
    """VeRL's per-source signature: only the fields it names."""
    return float(solution_str == str(ground_truth))


def wrong_arity(solution_str, ground_truth, rubric):
    """Needs an argument no reward call provides."""
    return 0.0
