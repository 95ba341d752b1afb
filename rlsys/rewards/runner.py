"""Score responses off the driver, in a pool of Ray actors, with a time limit per call.

A call that raises, runs past `timeout_s` or returns NaN scores 0 for that
term, is counted in `reward/errors`, and the first such traceback is logged
once; the run goes on.
"""

from __future__ import annotations

import logging
import math
import signal
import sys
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import ray

from rlsys.actors.cluster import actor_name, kill_named, spawn
from rlsys.actors.failures import wait_all
from rlsys.actors.phases import call
from rlsys.config.rl import RewardConfig
from rlsys.console import redirect_actor_output
from rlsys.rewards.loading import RewardFunction, resolve_term, term_label

log = logging.getLogger(__name__)


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


class _Term(NamedTuple):
    label: str
    fn: RewardFunction
    weight: float


class RewardTimeout(Exception):
    pass


class RewardRunner:
    def __init__(self, cfg: RewardConfig, role: str = "reward"):
        """`role` names the actors in the dashboard (rlsys/<role>/<i>)."""
        self.cfg = cfg
        self.names = [actor_name(role, i) for i in range(cfg.num_workers)]
        self.role = role
        self.terms = [_Term(term_label(t), resolve_term(t, f"reward.terms[{i}]"), t.weight)
                      for i, t in enumerate(cfg.terms)]
        self._workers: list = []
        self._logged_failure = False

    def score(self, items: list[RewardInput]) -> tuple[list[ScoredSample], dict[str, float]]:
        """Scores in the order of `items`, and this batch's reward metrics."""
        workers = self._pool()
        chunks = [items[i::len(workers)] for i in range(len(workers))]
        refs = [call(w.score, chunk, self.cfg.timeout_s) for w, chunk in zip(workers, chunks)]
        # Backstop for a call the in-actor alarm cannot interrupt (e.g. stuck in C code).
        limit = self.cfg.timeout_s * (len(self.terms) * max(map(len, chunks)) + 1) + 30
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=limit)
        finished = dict(zip(done, wait_all(done, [self.names[refs.index(r)] for r in done])))
        scored: list[ScoredSample] = [None] * len(items)
        for index, ref in enumerate(refs):
            if ref in finished:
                results = finished[ref]
            else:
                results = [_all_failed(self.terms, "reward worker timed out")] * len(chunks[index])
                self._replace_worker(index)
            scored[index::len(workers)] = results
        return scored, self.metrics(scored)

    def _pool(self) -> list:
        """Long-lived reward actors (no CPU reserved: they run between the trainer's phases)."""
        if not self._workers:
            self._workers = [self._start_worker(i) for i in range(self.cfg.num_workers)]
        return self._workers

    def _start_worker(self, index: int):
        return spawn(_RewardWorker, self.role, index, self.terms)

    def _replace_worker(self, index: int) -> None:
        kill_named([self._workers[index]], [self.names[index]])
        self._workers[index] = self._start_worker(index)

    def shutdown(self) -> None:
        if self._workers:
            kill_named(self._workers, self.names)
        self._workers = []

    def metrics(self, scored: list[ScoredSample]) -> dict[str, float]:
        errors = [e for s in scored for e in s.errors]
        if errors and not self._logged_failure:
            log.warning("a reward call failed; it scores 0 and counts in reward/errors (logged once):\n%s", errors[0])
            self._logged_failure = True
        metrics = {"reward/errors": float(len(errors))}
        for label in scored[0].terms if len(self.terms) > 1 else ():
            metrics[f"reward/{label}"] = _mean(s.terms[label] for s in scored)
        for key in {k for s in scored for k in s.extras}:
            metrics[f"reward/{key}"] = _mean(s.extras[key] for s in scored if key in s.extras)
        return metrics


@ray.remote(num_cpus=0)
class _RewardWorker:
    def __init__(self, terms: list[_Term]):
        redirect_actor_output()
        for term in terms:  # for imports a reward makes when called (its modules came by value)
            if term.fn.search_path and term.fn.search_path not in sys.path:
                sys.path.append(term.fn.search_path)
        self.terms = terms

    def score(self, items: list[RewardInput], timeout_s: float) -> list[ScoredSample]:
        return _score_chunk(self.terms, items, timeout_s)


def _score_chunk(terms: list[_Term], items: list[RewardInput], timeout_s: float) -> list[ScoredSample]:
    scored = [ScoredSample() for _ in items]
    for term in terms:
        if term.fn.batched:
            values = _guarded(lambda: _batched_call(term.fn, items), term.label, timeout_s)
            values = values if isinstance(values, list) else [values] * len(items)
        else:
            values = [_guarded(lambda item=item: term.fn(item), term.label, timeout_s) for item in items]
        for sample, value in zip(scored, values):
            _add(sample, term, value)
    return scored


def _batched_call(fn: RewardFunction, items: list[RewardInput]):
    result = fn(tuple(list(column) for column in zip(*items)))
    if not isinstance(result, (list, tuple)) or len(result) != len(items):
        raise ValueError(f"batched reward returned {type(result).__name__}, expected a list of {len(items)}")
    return list(result)


def _guarded(call, label: str, timeout_s: float):
    """The call's result, or a _Failure holding the traceback when it raised or timed out."""
    try:
        return _with_alarm(call, timeout_s)
    except Exception:  # any failure of user code becomes a counted zero
        return _Failure(f"reward {label!r}: {traceback.format_exc()}")


class _Failure(str):
    pass


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


def _add(sample: ScoredSample, term: _Term, value) -> None:
    if isinstance(value, _Failure):
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


def _all_failed(terms: list[_Term], reason: str) -> ScoredSample:
    return ScoredSample(terms={t.label: 0.0 for t in terms}, errors=[reason] * len(terms))


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
