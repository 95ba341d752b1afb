"""Scoring responses with a stage's reward terms: VeRL's reward inputs, each call under a time
limit, a failing, slow or non-numeric call scored 0 and kept as an error, the weighted sum of the
terms and their metrics. Pure: the reward actors that run it live in `rlsys.actors.reward_pool`."""

from __future__ import annotations

import math
import signal
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from rlsys.rewards.loading import RewardFunction


class RewardInput(NamedTuple):
    """The four fields of VeRL's reward signature; ground_truth and extra_info as stored."""

    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: Any


def reward_inputs(trajectories: list, prompts: list) -> list[RewardInput]:
    """One input per trajectory (`Trajectory`), with its prompt's (`Prompt`) data source, ground
    truth and extra info. A multi-turn loop's `reward_info` (turns, tool calls, tool rewards, the
    final turn) joins a dict extra_info, as VeRL adds `num_turns`; a single turn leaves it as stored."""
    return [RewardInput(prompts[t.prompt_index].data_source, t.text, prompts[t.prompt_index].ground_truth,
                        _with_reward_info(prompts[t.prompt_index].extra_info, t.reward_info)) for t in trajectories]


def _with_reward_info(extra_info: Any, reward_info: dict) -> Any:
    if not reward_info or not (extra_info is None or isinstance(extra_info, dict)):
        return extra_info
    return {**(extra_info or {}), **reward_info}


@dataclass
class ScoredSample:
    score: float = 0.0
    terms: dict[str, float] = field(default_factory=dict)
    extras: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


class Term(NamedTuple):
    label: str
    fn: RewardFunction | None
    """None for a term a served model scores (`rlsys.actors.reward_pool.ModelTerm`)."""
    weight: float


class RewardTimeout(Exception):
    pass


def reward_metrics(terms: list[Term], scored: list[ScoredSample]) -> dict[str, float]:
    """A batch's reward metrics: its errors, each term's mean (with several terms) and each extra's."""
    metrics = {"reward/errors": float(sum(len(s.errors) for s in scored))}
    for label in scored[0].terms if len(terms) > 1 else ():
        metrics[f"reward/{label}"] = _mean(s.terms[label] for s in scored)
    for key in {k for s in scored for k in s.extras}:
        metrics[f"reward/{key}"] = _mean(s.extras[key] for s in scored if key in s.extras)
    return metrics


def score_items(terms: list[Term], items: list[RewardInput], timeout_s: float) -> list[ScoredSample]:
    scored = [ScoredSample() for _ in items]
    for term in terms:
        if term.fn.batched:
            values = _guarded(lambda: _batched_call(term.fn, items), term.label, timeout_s)
            values = values if isinstance(values, list) else [values] * len(items)
        else:
            values = [_guarded(lambda item=item: term.fn(item), term.label, timeout_s) for item in items]
        add_term(scored, term, values)
    return scored


def add_term(scored: list[ScoredSample], term: Term, values: list) -> None:
    """One term's values (numbers, dicts with a score, or `Failure`s) added to the samples' scores."""
    for sample, value in zip(scored, values):
        _add(sample, term, value)


def _batched_call(fn: RewardFunction, items: list[RewardInput]):
    result = fn(tuple(list(column) for column in zip(*items)))
    if not isinstance(result, (list, tuple)) or len(result) != len(items):
        raise ValueError(f"batched reward returned {type(result).__name__}, expected a list of {len(items)}")
    return list(result)


def _guarded(call, label: str, timeout_s: float):
    """The call's result, or a Failure holding the traceback when it raised or timed out."""
    try:
        return _with_alarm(call, timeout_s)
    except Exception:  # any failure of user code becomes a counted zero
        return Failure(f"reward {label!r}: {traceback.format_exc()}")


class Failure(str):
    """A term's failed call for one sample: its traceback or reason, scored 0 and counted."""


def _with_alarm(call, timeout_s: float):
    if threading.current_thread() is not threading.main_thread():
        return call()

    def expire(signum, frame):
        raise RewardTimeout(f"reward call exceeded {timeout_s:g}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return call()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _add(sample: ScoredSample, term: Term, value) -> None:
    if isinstance(value, Failure):
        sample.errors.append(str(value))
        value = 0.0
    extras = {}
    if isinstance(value, dict):
        extras = {k: float(v) for k, v in value.items() if k != "score" and _is_number(v)}
        value = value.get("score", 0.0)
    try:
        value = float(value)
    except (TypeError, ValueError):
        sample.errors.append(f"reward {term.label!r} returned {value!r}, not a number")
        value = 0.0
    if not math.isfinite(value):
        sample.errors.append(f"reward {term.label!r} returned {value}")
        value = 0.0
    sample.terms[term.label] = value
    sample.score += term.weight * value
    sample.extras.update(extras)


def all_failed(terms: list[Term], reason: str) -> ScoredSample:
    return ScoredSample(terms={t.label: 0.0 for t in terms}, errors=[reason] * len(terms))


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
