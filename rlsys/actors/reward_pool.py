"""The reward actors: a pool of Ray actors that score a stage's responses off the driver
(`rlsys.rewards.scoring`), each call under a time limit (a worker stuck past its batch's limit is
replaced and its items fail; a worker that died is replaced and its items sent again: the group's
`wait_replacing`), and the engines of the terms a model scores (`ModelTerm`: a reward model or a
judge), all called at once."""

from __future__ import annotations

import logging

import ray

from rlsys.actors.cluster import actor_name, spawn
from rlsys.actors.failures import CallLimit, WorkerReplacements
from rlsys.actors.group import ActorGroup, Call
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


class RewardWorkers(ActorGroup[RewardWorker]):
    """Long-lived reward actors (no CPU reserved: they run between the trainer's phases); those an earlier
    pool of this role kept, where they are (`kept_actors`)."""

    stop_timeout_s = 0.0
    """Nothing outlives a worker's process: a pool that ends kills its workers at once (one may still run a
    reward past its time)."""

    def __init__(self, role: str, count: int, terms: list[Term]):
        super().__init__([actor_name(role, i) for i in range(count)])
        self.role, self.terms = role, terms
        if self.take_kept(role, ("workers", count)):
            self.reuse_kept(lambda _: (terms,))
        else:
            self.actors = [self._spawn(i) for i in range(count)]

    def _spawn(self, index: int):
        return spawn(ray.remote(num_cpus=0)(RewardWorker), self.role, index, self.terms)


class RewardPool:
    def __init__(self, cfg: RewardConfig, role: str = "reward", replacements: WorkerReplacements | None = None):
        """`role` names the actors in the dashboard (rlsys/<role>/<i>; a model term's engines
        rlsys/<role>_model<j>/<i>). A model term's engines start with `start_models`. `replacements`:
        the run's budget of dead workers to replace (None: a death fails the call)."""
        self.cfg = cfg
        self.role = role
        keyed = [(f"reward.terms[{i}]", t) for i, t in enumerate(cfg.terms)]
        self.function_terms = [Term(term_label(t), resolve_term(t, key), t.weight) for key, t in keyed if not t.model]
        self.model_terms = [ModelTerm(t, key) for key, t in keyed if t.model]
        self.terms = self.function_terms + [m.term for m in self.model_terms]
        self._workers: RewardWorkers | None = None
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
        count = len(workers.actors)
        chunks = [items[i::count] for i in range(count)]
        # Backstop for a call the in-actor alarm cannot interrupt (e.g. stuck in C code).
        limit = CallLimit(self.cfg.timeout_s * (len(self.function_terms) * max(map(len, chunks)) + 1) + 30,
                          "reward.timeout_s")
        calls = [workers.submit_call(i, RewardWorker.score, chunk, self.cfg.timeout_s)
                 for i, chunk in enumerate(chunks)]
        results = workers.wait_replacing(calls, limit=limit, if_hung=self._timed_out)
        scored: list[ScoredSample] = [None] * len(items)
        for index, chunk_scores in enumerate(results):
            scored[index::count] = chunk_scores
        return scored

    def _timed_out(self, call: Call) -> list[ScoredSample]:
        """A hung call's items, each failed."""
        return [all_failed(self.function_terms, "reward worker timed out")] * len(call.args[0])

    def _pool(self) -> RewardWorkers:
        if self._workers is None:
            self._workers = RewardWorkers(self.role, self.cfg.num_workers, self.function_terms)
            self._workers.replacements = self.replacements
        return self._workers

    def shutdown(self) -> None:
        if self._workers is not None:
            self._workers.shutdown()
        self._workers = None
        for term in self.model_terms:
            term.shutdown()

    def metrics(self, scored: list[ScoredSample]) -> dict[str, float]:
        """`reward_metrics`, and the first failure's traceback logged once."""
        errors = [e for s in scored for e in s.errors]
        if errors and not self._logged_failure:
            log.warning("a reward call failed; it scores 0 and counts in reward/errors (logged once):\n%s", errors[0])
            self._logged_failure = True
        return reward_metrics(self.terms, scored)
