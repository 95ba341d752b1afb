"""The one way the driver calls a group's actors (`rlsys.actors.group.ActorGroup`), on a group of plain
actors: a dead actor's calls go again to its replacement, those of every call in flight too, counted
against the run's replacements; a call past its limit is given the caller's result and its actor
replaced without counting; the first calls to finish are told apart from the rest; a method is named
by the worker's function, never by a string."""

from __future__ import annotations

import os
import sys
import time

import pytest
from ray import cloudpickle

pytestmark = pytest.mark.quick  # the quick tier (scripts/test.sh --quick)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors cannot import the tests


class Sleeper:
    def pid(self) -> int:
        return os.getpid()

    def nap(self, seconds: float, value: str) -> str:
        time.sleep(seconds)
        return value

    def shutdown(self) -> None:
        """What `ActorGroup.shutdown` asks of every actor before it kills them."""


def sleepers(count: int, limit: int):
    import ray

    from rlsys.actors.cluster import spawn
    from rlsys.actors.failures import WorkerReplacements
    from rlsys.actors.group import ActorGroup

    class Sleepers(ActorGroup[Sleeper]):
        def _spawn(self, index: int):
            return spawn(ray.remote(num_cpus=0)(Sleeper), "sleeper", index)

    group = Sleepers([f"rlsys/sleeper/{i}" for i in range(count)])
    group.actors = [group._spawn(i) for i in range(count)]
    group.replacements, group.stop_timeout_s = WorkerReplacements(limit), 1.0
    return group


def test_a_dead_actors_calls_and_those_in_flight_on_it_go_to_its_replacement(ray_cluster):
    import ray

    group = sleepers(2, limit=1)
    try:
        first_pid = group.run_all(Sleeper.pid)[0]
        waited = [group.submit_call(0, Sleeper.nap, 3.0, "a"), group.submit_call(1, Sleeper.nap, 0.0, "b")]
        also = group.submit_call(0, Sleeper.nap, 0.0, "c")  # in flight on the same actor, not waited for here
        ray.kill(group.actors[0])
        assert group.wait_replacing(waited, in_flight=[also]) == ["a", "b"]
        assert group.resent == 2 and group.replacements.used == 1
        assert group.run_all(Sleeper.pid)[0] != first_pid
        assert group.wait_replacing([also]) == ["c"]  # went to the replacement, not lost with the dead actor
        assert not group.failed  # every failure replaced: a healthy group, kept when it ends
    finally:
        group.shutdown()


def test_a_call_past_its_limit_takes_the_callers_result_and_its_actor_is_replaced_uncounted(ray_cluster):
    from rlsys.actors.failures import CallLimit

    group = sleepers(3, limit=0)
    try:
        pids = group.run_all(Sleeper.pid)
        calls = [group.submit_call(0, Sleeper.nap, 0.0, "fast"), group.submit_call(1, Sleeper.nap, 600.0, "slow"),
                 group.submit_call(2, Sleeper.nap, 600.0, "slow")]
        started = time.monotonic()
        results = group.wait_replacing(calls, limit=CallLimit(2.0, "test.timeout_s"),
                                       if_hung=lambda call: f"hung on {call.index}")
        assert results == ["fast", "hung on 1", "hung on 2"]
        assert time.monotonic() - started < 30  # both hung calls end at the one limit, not one limit each
        after = group.run_all(Sleeper.pid)
        assert after[0] == pids[0] and after[1] != pids[1] and after[2] != pids[2]
        assert group.replacements.used == 0 and not group.failed
    finally:
        group.shutdown()


def test_the_first_calls_to_finish_and_a_wait_past_its_time(ray_cluster):
    from rlsys.actors.failures import CallLimit, WorkerFailure

    group = sleepers(2, limit=0)
    try:
        slow, fast = group.submit_call(0, Sleeper.nap, 600.0, "slow"), group.submit_call(1, Sleeper.nap, 0.0, "fast")
        assert group.first_done([slow, fast], 1, timeout_s=60.0) == [fast]
        with pytest.raises(WorkerFailure, match=r"sleeper worker 0 .* returned no result within 1 s"):
            group.first_done([slow, fast], 2, timeout_s=1.0)
        with pytest.raises(WorkerFailure):
            group.wait_replacing([slow], limit=CallLimit(1.0, "test.timeout_s"))  # hung, and no replacement allowed
        assert group.failed  # not handed back to be kept
        with pytest.raises(TypeError, match="name the worker's method itself"):
            group.submit(0, "nap", 0.0, "x")
    finally:
        group.shutdown()
