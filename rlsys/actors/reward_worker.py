"""A reward actor: scores items with the function terms it was given (`rlsys.rewards.scoring`).

A module of its own, light to import (no torch, no vLLM): every reward actor of every run
imports what its class's module imports."""

from __future__ import annotations

import os
import sys

from rlsys.console import StartupClock, record_startup, redirect_actor_output
from rlsys.rewards.scoring import RewardInput, ScoredSample, Term, score_items


class RewardWorker:
    def __init__(self, terms: list[Term]):
        startup = StartupClock()
        redirect_actor_output()
        self._take(terms)
        record_startup("reward", startup)

    def _take(self, terms: list[Term]) -> None:
        for term in terms:  # for imports a reward makes when called (its modules came by value)
            if term.fn.search_path and term.fn.search_path not in sys.path:
                sys.path.append(term.fn.search_path)
        self.terms = terms

    def release(self) -> bool:
        """Forget the terms and what their calls imported from beside them, keeping the process for
        another pool's worker (`reuse`; `rlsys.actors.kept_actors`)."""
        paths = {term.fn.search_path for term in self.terms if term.fn.search_path}
        for name, module in list(sys.modules.items()):
            if any(os.path.abspath(getattr(module, "__file__", None) or "/").startswith(path + os.sep)
                   for path in paths):
                del sys.modules[name]
        sys.path[:] = [entry for entry in sys.path if entry not in paths]
        self.terms = []
        return True

    def reuse(self, log_file: str | None, terms: list[Term]) -> None:
        """After `release`: score with `terms`, writing to `log_file`."""
        startup = StartupClock()
        redirect_actor_output(log_file)
        self._take(terms)
        record_startup("reward", startup, reused=True)

    def score(self, items: list[RewardInput], timeout_s: float) -> list[ScoredSample]:
        return score_items(self.terms, items, timeout_s)

    def shutdown(self) -> None:
        """Nothing of a reward worker's outlives its process."""
