"""The reward actors: a pool of Ray actors that score a stage's responses off the driver
(`rlsys.rewards.scoring`), each call under a time limit; a worker stuck past its batch's limit is
replaced."""

from __future__ import annotations

import logging
import sys

import ray

from rlsys.actors.cluster import actor_name, kill_named, spawn
from rlsys.actors.failures import wait_all
from rlsys.actors.phases import call
from rlsys.config.rl import RewardConfig
from rlsys.console import redirect_actor_output
from rlsys.rewards.loading import resolve_term, term_label
from rlsys.rewards.scoring import RewardInput, ScoredSample, Term, all_failed, reward_metrics, score_items

log = logging.getLogger(__name__)


class RewardPool:
    def __init__(self, cfg: RewardConfig, role: str = "reward"):
        """`role` names the actors in the dashboard (rlsys/<role>/<i>)."""
        self.cfg = cfg
        self.names = [actor_name(role, i) for i in range(cfg.num_workers)]
        self.role = role
        self.terms = [Term(term_label(t), resolve_term(t, f"reward.terms[{i}]"), t.weight)
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
                results = [all_failed(self.terms, "reward worker timed out")] * len(chunks[index])
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
        """`reward_metrics`, and the first failure's traceback logged once."""
        errors = [e for s in scored for e in s.errors]
        if errors and not self._logged_failure:
            log.warning("a reward call failed; it scores 0 and counts in reward/errors (logged once):\n%s", errors[0])
            self._logged_failure = True
        return reward_metrics(self.terms, scored)


@ray.remote(num_cpus=0)
class _RewardWorker:
    def __init__(self, terms: list[Term]):
        redirect_actor_output()
        for term in terms:  # for imports a reward makes when called (its modules came by value)
            if term.fn.search_path and term.fn.search_path not in sys.path:
                sys.path.append(term.fn.search_path)
        self.terms = terms

    def score(self, items: list[RewardInput], timeout_s: float) -> list[ScoredSample]:
        return score_items(self.terms, items, timeout_s)
