"""A reward actor: scores items with the function terms it was given (`rlsys.rewards.scoring`).

A module of its own, light to import (no torch, no vLLM): every reward actor of every run
imports what its class's module imports."""

from __future__ import annotations

import sys

import ray

from rlsys.console import StartupClock, record_startup, redirect_actor_output
from rlsys.rewards.scoring import RewardInput, ScoredSample, Term, score_items


@ray.remote(num_cpus=0)
class RewardWorker:
    def __init__(self, terms: list[Term]):
        startup = StartupClock()
        redirect_actor_output()
        for term in terms:  # for imports a reward makes when called (its modules came by value)
            if term.fn.search_path and term.fn.search_path not in sys.path:
                sys.path.append(term.fn.search_path)
        self.terms = terms
        record_startup("reward", startup)

    def score(self, items: list[RewardInput], timeout_s: float) -> list[ScoredSample]:
        return score_items(self.terms, items, timeout_s)
