"""Actors kept between the groups of one driver. A training group, a rollout group or a reward pool that
ends healthy hands its actors back, with the placement they hold, instead of killing them, and the next
group of the same role and placement takes them: each actor drops what it built (a rank its model,
optimizer and process group; an engine its vLLM engine; a reward worker its terms) in `release`, then
builds what the new group asks in `reuse`, paying no process start. Most of an actor's start-up is the
process's own: Ray's worker, then the imports of torch, DTensor and transformers (a rank) or of vLLM
(an engine).

One set per role at most is kept (a group's actor names, rlsys/<role>/<index>, belong to one group
at a time), and only while `keep_actors(True)`: a driver that builds group after group turns it on
(a `pipeline`'s stages; a test suite; a notebook trying configurations); a single stage builds its
groups once per attempt and keeps nothing. A group whose placement differs from the kept set's, or a
placement group of engines of their own, first retires every kept set (their bundles hold CPUs and
GPUs, and colocated engines live in the training ranks' bundles). An actor that died, hung, or says it
cannot be kept (`release` returns False) is never kept: its whole set is killed as before."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from rlsys.actors.cluster import kill_named
from rlsys.actors.failures import CallLimit, wait_all
from rlsys.console import StartupClock, redirect_actor_output

RELEASE_TIMEOUT_S = 30.0
"""How long every actor of a group that ends may take to drop what it built; one that takes longer
is treated as hung, and the set is killed."""


@dataclass
class _Kept:
    key: tuple
    job: str
    placement: Any
    """What the set holds its place with, handed to the group that takes it."""
    free: Callable[[], None]
    """Frees the placement once the actors are killed."""
    actors: list
    names: list[str]


_keeping = False
_kept: dict[str, _Kept] = {}
"""By role: train, rollout, and each reward pool's (reward, val_reward)."""


class BuiltInPlace:
    """An engine actor whose constructor's work is `_build(startup, reused, *arguments)`, so that a kept
    one builds a new group's engine in its process (after its `release`)."""

    def reuse(self, log_file: str | None, *args) -> None:
        """Build the engine a new group asks for (the constructor's arguments), writing to `log_file`."""
        startup = StartupClock()
        redirect_actor_output(log_file)
        self._build(startup, True, *args)


def keep_actors(enabled: bool) -> None:
    """Keep the actors of a healthy group that ends for the next group of its role and placement (or
    stop, retiring every set kept)."""
    global _keeping
    _keeping = enabled
    if not enabled:
        retire()


def take(role: str, key: tuple) -> tuple[Any, list] | None:
    """The kept `role` set's placement and actors (index order) when it was kept under `key` on this
    Ray job; else None, having retired every kept set if this role's did not match."""
    kept = _kept.pop(role, None)
    if kept is not None and kept.key == key and kept.job == _job():
        return kept.placement, kept.actors
    if kept is not None:
        _kill(kept)
        retire()
    return None


def hand_back(role: str, key: tuple, placement: Any, free: Callable[[], None], actors: list,
              names: list[str]) -> bool:
    """Keep a group's actors under `key` if keeping is on and every actor released what it built in
    time; False (nothing kept) otherwise: the caller kills them and frees `placement`."""
    if not _keeping or not actors or not ray.is_initialized():
        return False
    try:
        releasable = wait_all([actor.release.remote() for actor in actors], names,
                              limit=CallLimit(RELEASE_TIMEOUT_S, ""))
    except Exception:  # a dead or hung actor, or one whose process group would not close
        return False
    if not all(releasable):
        return False
    if role in _kept:
        _kill(_kept.pop(role))
    _kept[role] = _Kept(key, _job(), placement, free, actors, names)
    return True


def make_room(resources: dict[str, float]) -> None:
    """Retire every kept set unless the cluster has `resources` free beside them (a group about to place
    itself: an eval's kept engine may hold the CPUs its ranks need)."""
    free = ray.available_resources() if ray.is_initialized() else {}
    if _kept and any(free.get(name, 0.0) < amount for name, amount in resources.items()):
        retire()


def retire() -> None:
    """Kill every kept set and free its placement."""
    while _kept:
        _kill(_kept.pop(next(iter(_kept))))


def _kill(kept: _Kept) -> None:
    if kept.job == _job():  # else its cluster is gone, and the actors with it
        kill_named(kept.actors, kept.names)
        kept.free()


def _job() -> str:
    return ray.get_runtime_context().get_job_id() if ray.is_initialized() else ""
