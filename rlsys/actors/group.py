"""What every group of rlsys actors shares: its actors and their dashboard names, calls on
one actor or on all of them, waits that turn a dead actor into a `WorkerFailure`, and the
shutdown. The training and rollout groups add their placement and their own calls."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlsys.actors.cluster import shut_down
from rlsys.actors.failures import wait_all
from rlsys.actors.phases import call


def contiguous_shares(items: list, parts: int) -> list[list]:
    """`items` cut into `parts` contiguous shares, in order (sizes differ by at most one; some may be empty)."""
    return [items[i * len(items) // parts:(i + 1) * len(items) // parts] for i in range(parts)]


class ActorGroup:
    def __init__(self, names: list[str], straggler_timeout_s: float | None = None):
        self.names = names
        self.actors: list = []
        self.straggler_timeout_s = straggler_timeout_s
        """A call still running this long after another call of the group returned is a hang."""

    def submit(self, index: int, method: str, *args: Any, **kwargs: Any):
        """Start `method` on actor `index`; returns its object ref."""
        return call(getattr(self.actors[index], method), *args, **kwargs)

    def submit_all(self, method: str, *args: Any, **kwargs: Any) -> list:
        """Start `method` with the same arguments on every actor; returns their object refs."""
        return [self.submit(index, method, *args, **kwargs) for index in range(len(self.actors))]

    def wait(self, refs: list, indices: list[int] | None = None, straggler_timeout_s: float | None = None) -> list:
        """The results of calls on the actors at `indices` (default: one call per actor, in order);
        `straggler_timeout_s` replaces the group's for this wait."""
        names = self.names if indices is None else [self.names[i] for i in indices]
        return wait_all(refs, names, straggler_timeout_s or self.straggler_timeout_s)

    def run_all(self, method: str, *args: Any, **kwargs: Any) -> list:
        """Call `method` with the same arguments on every actor; results in actor order."""
        return self.wait(self.submit_all(method, *args, **kwargs))

    def on_each(self, fn: Callable, *args: Any) -> list:
        """Run `fn(actor_instance, *args)` inside every actor (Ray's `__ray_call__`); results in
        actor order. For what is not one of the actors' own methods: where an actor runs, or a
        test's look inside it."""
        return self.wait([actor.__ray_call__.remote(fn, *args) for actor in self.actors])

    def shutdown(self) -> None:
        """Let the actors that still answer release what outlives a killed process, then kill them all."""
        shut_down(self.actors, self.names)
