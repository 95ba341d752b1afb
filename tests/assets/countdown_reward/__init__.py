"""A reward package: the countdown task, whose ground truth is a dict {target, numbers}."""

from .scoring import compute_score

__all__ = ["compute_score"]
