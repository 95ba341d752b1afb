"""What every group of rlsys actors shares: its actors and their dashboard names, calls on
one actor or on all of them, waits that turn a dead actor into a `WorkerFailure`, and the
shutdown. The training and rollout groups add their placement and their own calls.

A group that can build one of its actors again (`_spawn`) replaces a dead one in place: a new
actor under the same name, with the same arguments and placement, brought to the group's state
by `restore` (a rollout engine: the current weights), its unfinished calls sent again
(`wait_replacing`), as far as the run's `WorkerReplacements` allow. An actor whose call runs past
the group's `call_limit` is hung, and replaced the same way, or its call given a result of the
caller's (`if_hung`: a reward whose time ran out scores as failed).

Every group calls its actors this way: the training ranks, the rollout engines (the asynchronous
stream's groups in flight too), the reward workers and the served models' engines.

A driver that builds group after group (a pipeline's stages) keeps a healthy group's actors when it
ends, and the next group of the same role and placement takes them (`take_kept`, `reuse_kept`;
`rlsys.actors.kept_actors`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

import ray

from rlsys.actors import kept_actors
from rlsys.actors.cluster import kill_named, log_file_of, shut_down
from rlsys.actors.failures import CallLimit, WorkerFailure, WorkerReplacements, wait_all
from rlsys.actors.phases import call, current_phase
from rlsys.models.hub import size_text, weights_bytes
from rlsys.tracking.trace import span

log = logging.getLogger(__name__)


Worker = TypeVar("Worker")
"""The class of a group's actors (`TrainWorker`, `RolloutWorker`, ...)."""
P = ParamSpec("P")
R = TypeVar("R")
Method = Callable[Concatenate[Worker, P], R]
"""A method of the group's worker class, named by the function itself (`RolloutWorker.rollout`): a reader
follows it to its definition and a type checker checks its arguments."""


def method_name(method: Callable) -> str:
    if isinstance(method, str):
        raise TypeError(f"name the worker's method itself (e.g. RolloutWorker.rollout), not the string {method!r}")
    return method.__name__


def contiguous_shares(items: list, parts: int) -> list[list]:
    """`items` cut into `parts` contiguous shares, in order (sizes differ by at most one; some may be empty)."""
    return [items[i * len(items) // parts:(i + 1) * len(items) // parts] for i in range(parts)]


@dataclass
class Call:
    """A call started on actor `index` of a group, with what it takes to send it again."""

    index: int
    method: Callable
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    ref: Any = None
    actor: Any = None
    """The actor it went to."""


ENGINE_STOP_S = 120.0
"""A vLLM engine group's `stop_timeout_s`: an engine's stop ends its worker processes and unlinks its
shared-memory queues in /dev/shm, which a tensor-parallel engine on a loaded machine took over 10 s to
do; killed before that, the queues outlive it."""


class ActorGroup(Generic[Worker]):
    stop_timeout_s: float = 10.0
    """How long `shutdown` lets the actors release what outlives a killed process before killing them."""

    def __init__(self, names: list[str], straggler_timeout_s: float | None = None):
        self.names = names
        self.actors: list = []
        self.straggler_timeout_s = straggler_timeout_s
        """A call still running this long after another call of the group returned is a hang."""
        self.replacements: WorkerReplacements | None = None
        """The run's budget of dead workers to replace; None: a death fails the call."""
        self.restore: Callable[[int], None] | None = None
        """Brings a replacement actor (its index) to the state of the others before it takes calls."""
        self.call_limit: CallLimit | None = None
        """A call running longer than this is a hung actor: a failure, replaced as a death is."""
        self.failed = False
        """A wait of this group has failed (a dead, hung or erring actor)."""
        self.resent = 0
        """Calls sent again to an actor that replaced the one they went to, over the group's life."""
        self.placement: Any = None
        """What holds the actors' resources (a placement group's bundles), freed by `release()` once they
        are gone; None: nothing of their own."""
        self.keep_role: str = ""
        self.keep_key: tuple | None = None
        """What a group must match to take this group's actors when it ends (`take_kept`); None: they are not
        kept."""

    def take_kept(self, role: str, key: tuple | None) -> bool:
        """Take the actors and placement an earlier group of `role` kept under `key`, if any (then
        `reuse_kept`); else the group places and spawns its own. Under `key` this group's own actors are
        kept in turn when it ends (None: never)."""
        self.keep_role, self.keep_key = role, key
        kept = kept_actors.take(role, key)
        if kept is None:
            return False
        self.placement, self.actors = kept
        return True

    def reuse_kept(self, args_of: Callable[[int], tuple]) -> None:
        """Each taken actor builds what this group asks of its index (`reuse(log_file, *args_of(index))`)."""
        self.wait([actor.reuse.remote(log_file_of(name), *args_of(index))
                   for index, (actor, name) in enumerate(zip(self.actors, self.names))])

    def start_engines(self, model_path: str) -> None:
        """Spawn one engine per name (`_spawn`) and wait until each has loaded `model_path`, saying on the
        console when they start and as each is ready."""
        count = len(self.names)
        log.info("%s: starting %d vLLM engine%s of %s (%s)", self.names[0].split("/")[1], count,
                 "s" if count > 1 else "", model_path, size_text(weights_bytes(model_path)))
        started = time.perf_counter()
        self.actors = [self._spawn(i) for i in range(count)]
        self.wait([actor.__ray_ready__.remote() for actor in self.actors],
                  on_result=lambda i: log.info("%s ready in %.1f s", self.names[i], time.perf_counter() - started))

    def submit(self, index: int, method: Method[Worker, P, R], *args: P.args, **kwargs: P.kwargs):
        """Start `method` on actor `index`; returns its object ref."""
        return call(getattr(self.actors[index], method_name(method)), *args, **kwargs)

    def submit_call(self, index: int, method: Method[Worker, P, R], *args: P.args, **kwargs: P.kwargs) -> Call:
        """Start `method` on actor `index`; the call, for `wait_replacing`."""
        return Call(index, method, args, kwargs, self.submit(index, method, *args, **kwargs), self.actors[index])

    def submit_all(self, method: Method[Worker, P, R], *args: P.args, **kwargs: P.kwargs) -> list:
        """Start `method` with the same arguments on every actor; returns their object refs."""
        return [self.submit(index, method, *args, **kwargs) for index in range(len(self.actors))]

    def wait(self, refs: list, indices: list[int] | None = None, straggler_timeout_s: float | None = None,
             on_result: Callable[[int], None] | None = None, limit: CallLimit | None = None) -> list:
        """The results of calls on the actors at `indices` (default: one call per actor, in order);
        `straggler_timeout_s` and `limit` replace the group's for this wait; `on_result`: told each
        call's index as it returns."""
        names = self.names if indices is None else [self.names[i] for i in indices]
        try:
            return wait_all(refs, names, straggler_timeout_s or self.straggler_timeout_s, limit or self.call_limit,
                            on_result)
        except BaseException:
            self.failed = True
            raise

    def wait_replacing(self, calls: list[Call], in_flight: Iterable[Call] = (), limit: CallLimit | None = None,
                       if_hung: Callable[[Call], Any] | None = None) -> list:
        """The results of `calls`, in order. A call whose actor died (or hung) is sent again to the actor
        that replaces it (`replace_dead`), and so is every call of `in_flight` that went to it; the
        others' results are kept. `limit` replaces the group's `call_limit`; with `if_hung`, a call past
        it has `if_hung(call)` for its result instead, and its actor is replaced without counting
        against the run's replacements (the call's work hung, not the actor). A group whose every
        failure here was replaced is as healthy as before: it may still be kept when it ends."""
        results: dict[int, Any] = {}
        failed_before = self.failed
        while True:
            waiting = [i for i in range(len(calls)) if i not in results]
            try:
                results.update(zip(waiting, self.wait([calls[i].ref for i in waiting],
                                                      [calls[i].index for i in waiting], limit=limit)))
                self.failed = failed_before
                return [results[i] for i in range(len(calls))]
            except WorkerFailure as failure:
                if failure.hung and if_hung is not None:
                    for i in _unfinished(calls, waiting):
                        self.replace(calls[i].index)
                        results[i] = if_hung(calls[i])
                else:
                    self.resend_lost(self.replace_dead(failure), [*calls, *in_flight])

    def resend_lost(self, index: int, calls: Iterable[Call]) -> None:
        """Send each of `calls` that went to actor `index` before it was replaced again, to its successor."""
        for c in calls:
            if c.index == index and c.actor is not self.actors[index]:
                c.ref, c.actor = self.submit(index, c.method, *c.args, **c.kwargs), self.actors[index]
                self.resent += 1

    def first_done(self, calls: list[Call], count: int, timeout_s: float) -> list[Call]:
        """The first `count` of `calls` to finish, in their order (their results, or their actors' deaths,
        are `wait_replacing`'s to take); a wait past `timeout_s` is the failure of the first call's actor
        that has not finished."""
        if count == 0:
            return []
        done, _ = ray.wait([c.ref for c in calls], num_returns=count, timeout=timeout_s)
        finished = set(done)
        if len(done) < count:
            late = next(c for c in calls if c.ref not in finished)
            raise WorkerFailure(self.names[late.index], f"returned no result within {timeout_s:g} s", current_phase())
        return [c for c in calls if c.ref in finished]

    def replace_dead(self, failure: Exception) -> int:
        """Replace the actor a `WorkerFailure` names, if it is one of this group's and the run allows
        one more replacement; its index. A failure of an actor already replaced (a call sent to it
        before) replaces nothing. Any other error goes on up, and so does a failure that is not the
        actor's own death or hang (a peer's error that reached it)."""
        if not isinstance(failure, WorkerFailure) or not failure.replaceable or failure.worker not in self.names:
            raise failure
        index = self.names.index(failure.worker)
        if failure.actor_id is not None and failure.actor_id != self.actors[index]._actor_id.hex():
            return index
        if self.replacements is None or not self.replacements.allow(failure):
            raise failure
        with span(f"replace {failure.worker}"):
            self.replace(index)
        return index

    def replace(self, index: int) -> None:
        """A new actor in place of actor `index` (killed first, if it still runs), ready and restored."""
        kill_named([self.actors[index]], [self.names[index]])
        self.actors[index] = self._spawn(index)
        wait_all([self.actors[index].__ray_ready__.remote()], [self.names[index]])  # starting has no call limit
        if self.restore is not None:
            self.restore(index)

    def _spawn(self, index: int):
        """Create actor `index` (groups that can replace their actors build them here)."""
        raise NotImplementedError(f"{type(self).__name__} does not replace its actors")

    def run_all(self, method: Method[Worker, P, R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Call `method` with the same arguments on every actor; results in actor order."""
        return self.wait(self.submit_all(method, *args, **kwargs))

    def on_each(self, fn: Callable, *args: Any) -> list:
        """Run `fn(actor_instance, *args)` inside every actor (Ray's `__ray_call__`); results in
        actor order. For what is not one of the actors' own methods: where an actor runs, or a
        test's look inside it."""
        return self.wait([actor.__ray_call__.remote(fn, *args) for actor in self.actors])

    def shutdown(self) -> None:
        """Hand the actors back to be kept, when keeping is on and the group is healthy (`kept_actors`);
        else let those that still answer release what outlives a killed process, kill them all (a group
        that failed, whose actors may hang, gets the shorter of its time and the default), and free
        their placement."""
        if self.keep_key is not None and not self.failed and kept_actors.hand_back(
                self.keep_role, self.keep_key, self.placement, self._release_placement, self.actors, self.names):
            return
        failed_s = min(self.stop_timeout_s, ActorGroup.stop_timeout_s)
        shut_down(self.actors, self.names, failed_s if self.failed else self.stop_timeout_s)
        self._release_placement()

    def _release_placement(self) -> None:
        if self.placement is not None:
            self.placement.release()


def _unfinished(calls: list[Call], indices: list[int]) -> list[int]:
    """Those of `indices` whose call has not finished."""
    ready, _ = ray.wait([calls[i].ref for i in indices], num_returns=len(indices), timeout=0)
    finished = set(ready)
    return [i for i in indices if calls[i].ref not in finished]
