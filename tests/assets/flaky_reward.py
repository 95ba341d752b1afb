"""A reward file outside the package, in VeRL's compute_score form, that misbehaves on purpose."""

import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "raise":
        raise RuntimeError("this reward fails on purpose")
    if solution_str == "sleep":
        time.sleep(30)
    if solution_str == "nan":
        return float("nan")
    return {"score": float(solution_str == ground_truth), "length": len(solution_str)}


def batched_score(data_sources, solution_strs, ground_truths, extra_infos):
    return [float(s == g) for s, g in zip(solution_strs, ground_truths)]
