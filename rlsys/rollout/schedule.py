"""The order of the events that decide an engine's tokens, recorded or followed.

Given its weights, what an engine samples depends on which requests each of its steps runs
(vLLM batches them, preempts and recomputes them) and on the step before which new weights
land. Under asynchronous RL both follow the clock: when the driver's calls, the tool results
and the syncs arrive. `EngineSchedule` writes them down as they happen, by engine step: the
requests added before each step, in the order added, and the versions synced before it. Given
such a record, it makes the engine follow it instead of the clock: a step waits until the
requests and the sync recorded before it have arrived, a request that arrives early waits for
its step, and a sync that arrives early waits for the engine to reach its step. Past the end of
the record the engine runs by the clock again and records.

A request is known by what it asks (its prompt and pictures, seed, temperature and token budget), which does
not depend on timing; requests that ask alike sample alike, so which of them goes first does not
matter.
"""

from __future__ import annotations

import asyncio
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from rlsys.config.loader import ConfigError

POLL_S = 0.001


class ScheduleDiverged(ConfigError):
    """The run cannot follow `train.replay`'s record: it differs from the run recorded."""

    def __init__(self, why: str):
        super().__init__(f"train.replay: {why}: this job is not the one recorded (its config, seed or data differ)")


def request_key(prompt_ids: list[int], params, images: list | None = None) -> str:
    """A request's name in a schedule: its seed, temperature and token budget, its prompt's length
    and checksum, that of its pictures too (vLLM `SamplingParams`; PIL images)."""
    checksum = zlib.crc32(np.asarray(prompt_ids, dtype=np.int64).tobytes())
    for image in images or ():
        checksum = zlib.crc32(f"{image.mode}{image.size}".encode() + image.tobytes(), checksum)
    return f"{params.seed}:{params.temperature:g}:{params.max_tokens}:{len(prompt_ids)}:{checksum:08x}"


@dataclass
class EngineSchedule:
    step: int = 0
    """Engine steps taken, counted from the run's start (a resumed engine starts where the
    checkpoint's left off)."""
    active: bool = False
    """Recording (an asynchronous run's engine); an engine that nobody asks for its record (a
    synchronous run's, the eval stage's) keeps none."""
    recorded: list[list] = field(default_factory=list)
    """Events since the last `take`: [step, "add", key] and [step, "sync", version]."""
    plan_adds: dict[int, list[str]] = field(default_factory=dict)
    plan_syncs: dict[int, list[int]] = field(default_factory=dict)
    plan_end: int = -1
    """The last step the plan still says anything about; past it the engine runs by the clock."""
    failed: BaseException | None = None
    """Why the engine stopped serving: a wait for the plan gives up with it."""

    def follow(self, events: list[list], start: int) -> None:
        """Record from engine step `start` on, following `events` (a record's, in order; none: the
        clock); forget what was recorded before (a resumed run's sync of the restored weights, which
        the record's run did not do)."""
        self.step, self.recorded, self.active = start, [], True
        self.plan_adds, self.plan_syncs = {}, {}
        for step, kind, what in events:
            if step >= start:
                (self.plan_adds if kind == "add" else self.plan_syncs).setdefault(step, []).append(what)
        self._find_end()

    def _find_end(self) -> None:
        pending = [step for step, versions in self.plan_syncs.items() if versions]
        self.plan_end = max([*self.plan_adds, *pending], default=-1)

    @property
    def following(self) -> bool:
        return self.step <= self.plan_end

    def take(self) -> list[list]:
        """The events recorded since the last call."""
        events, self.recorded = self.recorded, []
        return events

    # -- what the engine reports --

    def added(self, keys: list[str]) -> None:
        if self.active:
            self.recorded.extend([self.step, "add", key] for key in keys)

    def synced(self, version: int) -> None:
        if not self.active:
            return
        if self.following:
            due = self.plan_syncs.get(self.step, [])
            if not due or due[0] != version:
                raise ScheduleDiverged(f"version {version} synced before engine step {self.step}, where the "
                                       f"record has {due or 'no sync'}")
            due.pop(0)
            self._find_end()  # past a record's last sync, the clock
        self.recorded.append([self.step, "sync", version])

    def stepped(self) -> None:
        self.step += 1

    # -- following the plan --

    def due(self, submitted: list[str]) -> list[str]:
        """The keys of the requests to add before this step: the record's (`wait_for_step` saw them
        all arrive), or every one `submitted` when running by the clock."""
        return list(self.plan_adds.get(self.step, [])) if self.following else list(submitted)

    async def wait_for_step(self, submitted: Callable[[], list[str]]) -> None:
        """Wait until the syncs recorded before this step have landed and its requests have arrived
        (`submitted()`: the keys of the requests waiting to be added)."""
        while self.following:
            missing = Counter(self.plan_adds.get(self.step, [])) - Counter(submitted())
            if not self.plan_syncs.get(self.step) and not missing:
                return
            await asyncio.sleep(POLL_S)

    async def wait_for_sync(self) -> None:
        """Wait until the engine reaches the step before which the record's next sync landed."""
        while self.following:
            pending = [step for step, versions in self.plan_syncs.items() if versions]
            if not pending:
                return
            if min(pending) < self.step:
                raise ScheduleDiverged(f"engine step {self.step} passed the sync recorded before step {min(pending)}")
            if min(pending) == self.step:
                return
            if self.failed is not None:
                raise RuntimeError(f"the engine stopped serving ({self.failed!r}) before the step this sync "
                                   "was recorded before")
            await asyncio.sleep(POLL_S)
