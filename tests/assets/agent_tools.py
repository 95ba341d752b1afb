"""Tools for the agent tests: one that raises, one that sleeps past its time limit."""

import time


def broken(expression: str) -> str:
    """Always fails."""
    raise ValueError(f"cannot evaluate {expression}")


def slow(seconds: float) -> str:
    """Sleeps."""
    time.sleep(seconds)
    return "done"
