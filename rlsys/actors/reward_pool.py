"""The reward actors: a pool of Ray actors that score a stage's responses off the driver
(`rlsys.rewards.scoring`), each call under a time limit (a worker stuck past its batch's limit is
replaced and its items fail; a worker that died is replaced and its items sent again), and the
engines of the terms a model scores (`ModelTerm`: a reward model or a judge), all called at once."""

from __future__ import annotations

import logging

import ray

from rlsys.actors import kept_actors
from rlsys.actors.cluster import actor_name, kill_named, log_file_of, spawn
from rlsys.actors.failures import WorkerFailure, WorkerReplacements, wait_all
from rlsys.actors.phases import call
from rlsys.actors.reward_worker import RewardWorker
from rlsys.actors.served_models import ServedModelGroup, ServedModelWorker
from rlsys.config.rl import RewardConfig, RewardTerm
from rlsys.rewards.loading import resolve_term, term_label
from rlsys.rewards.model_terms import (
    Exchange,
    VerdictError,
    judge_request,
    model_label,
    normalized,
    parse_verdict,
    read_template,
    verdict_parser,
)
from rlsys.rewards.scoring import (
    Failure,
    RewardInput,
    ScoredSample,
    Term,
    add_term,
    all_failed,
    reward_metrics,
)

log = logging.getLogger(__name__)


class ModelTerm:
    """A reward term a served model scores: a reward model's logit, or a judge's parsed verdict."""

    def __init__(self, term: RewardTerm, key: str):
        self.cfg, self.key = term, key
        self.term = Term(model_label(term), None, term.weight)
        self.template = read_template(term.judge.template, f"{key}.judge.template") if term.judge else None
        self.parser = verdict_parser(term.judge, f"{key}.judge") if term.judge else None
        self.engines: ServedModelGroup | None = None
        self.calls = 0

    def start(self, role: str, seed: int, **placement) -> None:
        """The term's engines, rlsys/<role>/<i>, placed as `ServedModelGroup` takes `placement`."""
        self.engines = ServedModelGroup(role, self.cfg.model, self.cfg.serving, seed, f"{self.key}.serving",
                                        pooling=self.template is None, **placement)

    def submit(self, exchanges: list[Exchange]) -> list:
        if self.template is None:
            return self.engines.submit_split(ServedModelWorker.reward_scores, exchanges)
        judge, self.calls = self.cfg.judge, self.calls + 1
        requests = [judge_request(self.template, e) for e in exchanges]
        return self.engines.submit_split(ServedModelWorker.verdicts, requests, judge.max_new_tokens, judge.temperature,
                                         self.calls * 1_000_003)

    def values(self, pending: list) -> list[float | Failure]:
        """The scores of a `submit`, normalised as the term asks; a verdict without one is a `Failure`."""
        outputs = self.engines.gather(pending)
        if self.parser is not None:
            outputs = [self._parsed(verdict) for verdict in outputs]
        numbers = [v for v in outputs if not isinstance(v, Failure)]
        scaled = iter(normalized(numbers, self.cfg.normalize))
        return [v if isinstance(v, Failure) else next(scaled) for v in outputs]

    def _parsed(self, verdict: str) -> float | Failure:
        try:
            return parse_verdict(self.parser, verdict)
        except VerdictError as err:
            return Failure(f"reward {self.term.label!r}: {err}")

    def shutdown(self) -> None:
        if self.engines is not None:
            self.engines.shutdown()
        self.engines = None


class RewardPool:
    def __init__(self, cfg: RewardConfig, role: str = "reward", replacements: WorkerReplacements | None = None):
        """`role` names the actors in the dashboard (rlsys/<role>/<i>; a model term's engines
        rlsys/<role>_model<j>/<i>). A model term's engines start with `start_models`. `replacements`:
        the run's budget of dead workers to replace (None: a death fails the call)."""
        self.cfg = cfg
        self.names = [actor_name(role, i) for i in range(cfg.num_workers)]
        self.role = role
        keyed = [(f"reward.terms[{i}]", t) for i, t in enumerate(cfg.terms)]
        self.function_terms = [Term(term_label(t), resolve_term(t, key), t.weight) for key, t in keyed if not t.model]
        self.model_terms = [ModelTerm(t, key) for key, t in keyed if t.model]
        self.terms = self.function_terms + [m.term for m in self.model_terms]
        self._workers: list = []
        self._keep_key = ("workers", cfg.num_workers)
        self._logged_failure = False
        self.replacements = replacements

    def start_models(self, seed: int, **placement) -> None:
        """Start the model terms' engines (`ServedModelGroup`'s placement arguments)."""
        for j, term in enumerate(self.model_terms):
            term.start(f"{self.role}_model{j}", seed, **placement)
            term.engines.replacements = self.replacements

    def score(self, items: list[RewardInput], exchanges: list[Exchange] | None = None
              ) -> tuple[list[ScoredSample], dict[str, float]]:
        """Scores in the order of `items`, and this batch's reward metrics; `exchanges` (the same
        samples with their prompts) for the model terms. Every term's calls run at once."""
        pending = [(term, term.submit(exchanges)) for term in self.model_terms]
        scored = self._score_functions(items) if self.function_terms else [ScoredSample() for _ in items]
        for term, calls in pending:
            add_term(scored, term.term, term.values(calls))
        return scored, self.metrics(scored)

    def _score_functions(self, items: list[RewardInput]) -> list[ScoredSample]:
        """Each worker scores every len(workers)-th item. A worker past its batch's time limit is
        replaced and its items fail; a worker that died is replaced and its items sent again, as
        the run's `replacements` allow."""
        workers = self._pool()
        chunks = [items[i::len(workers)] for i in range(len(workers))]
        # Backstop for a call the in-actor alarm cannot interrupt (e.g. stuck in C code).
        limit = self.cfg.timeout_s * (len(self.function_terms) * max(map(len, chunks)) + 1) + 30
        pending = {index: self._submit_chunk(index, chunk) for index, chunk in enumerate(chunks)}
        scored: list[ScoredSample] = [None] * len(items)
        while pending:
            done, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=limit)
            for index, ref in list(pending.items()):
                del pending[index]
                if ref not in done:
                    results = [all_failed(self.function_terms, "reward worker timed out")] * len(chunks[index])
                    self._replace_worker(index)
                else:
                    try:
                        [results] = wait_all([ref], [self.names[index]])
                    except WorkerFailure as failure:
                        if self.replacements is None or not self.replacements.allow(failure):
                            raise
                        self._replace_worker(index)
                        pending[index] = self._submit_chunk(index, chunks[index])
                        continue
                scored[index::len(workers)] = results
        return scored

    def _submit_chunk(self, index: int, chunk: list[RewardInput]):
        return call(self._workers[index].score, chunk, self.cfg.timeout_s)

    def _pool(self) -> list:
        """Long-lived reward actors (no CPU reserved: they run between the trainer's phases); those
        an earlier pool of this role kept, where they are (`kept_actors`)."""
        if not self._workers:
            kept = kept_actors.take(self.role, self._keep_key)
            if kept is None:
                self._workers = [self._start_worker(i) for i in range(self.cfg.num_workers)]
            else:
                self._workers = kept[1]
                wait_all([worker.reuse.remote(log_file_of(name), self.function_terms)
                          for worker, name in zip(self._workers, self.names)], self.names)
        return self._workers

    def _start_worker(self, index: int):
        return spawn(RewardWorker, self.role, index, self.function_terms)

    def _replace_worker(self, index: int) -> None:
        kill_named([self._workers[index]], [self.names[index]])
        self._workers[index] = self._start_worker(index)

    def shutdown(self) -> None:
        if self._workers and not kept_actors.hand_back(self.role, self._keep_key, None, lambda: None,
                                                       self._workers, self.names):
            kill_named(self._workers, self.names)
        self._workers = []
        for term in self.model_terms:
            term.shutdown()

    def metrics(self, scored: list[ScoredSample]) -> dict[str, float]:
        """`reward_metrics`, and the first failure's traceback logged once."""
        errors = [e for s in scored for e in s.errors]
        if errors and not self._logged_failure:
            log.warning("a reward call failed; it scores 0 and counts in reward/errors (logged once):\n%s", errors[0])
            self._logged_failure = True
        return reward_metrics(self.terms, scored)
