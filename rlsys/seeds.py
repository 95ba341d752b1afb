"""Every seed a run derives from its `seed`, in one module: the seed of each engine, of each step's
prompt draw (or each asynchronous group), of each request and sample in a call, and of each model turn
of a multi-turn sample. A run repeats its tokens exactly (resume, restarts, a followed schedule) because
these are pure functions of the run's seed and the position of what they seed."""

from __future__ import annotations

DRAW_STRIDE = 100_003
"""The run's seed x this, plus the step (or an asynchronous group's serial): its prompt draw's seed."""
REDRAW_STRIDE = 1_000_000_007
"""DAPO's further draws of a step: draw d adds d x this."""
REQUEST_STRIDE = 1_000_003
"""A call's seed x this, plus the prompt's place in the call and the sample's in its group: a request's seed."""
TURN_STRIDE = 1_000_000_007
"""Model turn t of a sample adds t x this to its request's seed (turn 0 samples as a single turn does)."""


def engine_seed(run_seed: int, index: int) -> int:
    """Engine `index` of a group (rollout, served model)."""
    return run_seed + index


def draw_seed(run_seed: int, step: int, draw: int = 0) -> int:
    """The prompts a synchronous step draws (`draw`: DAPO's further draws of the step)."""
    return run_seed * DRAW_STRIDE + step + draw * REDRAW_STRIDE


def group_seed(run_seed: int, serial: int) -> int:
    """An asynchronous run's prompt group, by the order it was drawn in."""
    return run_seed * DRAW_STRIDE + serial


def request_seed(call_seed: int, prompt: int, sample: int) -> int:
    """Sample `sample` of the call's prompt `prompt`."""
    return call_seed * REQUEST_STRIDE + prompt + sample


def turn_seed(request: int, turn: int) -> int:
    """Model turn `turn` of a sample whose request seed is `request`."""
    return request + turn * TURN_STRIDE
