"""Asynchronous RL: prompt groups generated ahead of training.

A group is one prompt's `rollout.n` trajectories, one call on one engine. The stream keeps
groups in flight on the engines (`train.async_mode: one_step`: this step's and the next
step's; `full`: 1 + `train.max_staleness` steps' worth), so the engines generate while the
trainer updates. A step takes `train.prompts_per_step` finished groups: in the order they
were drawn (one_step), or in the order they finish (full). A group holding a token more
than `max_staleness` policy versions older than the policy being updated is dropped, counted,
and its prompt generated again: no prompt is lost or trained twice.

Seeds follow the order groups are drawn in, so the samples do not depend on timing; which
weights sampled each token does (the engines' speed against the trainer's) unless every sync
waits for the groups in flight (`train.partial_rollout: false`). A checkpoint waits for the
groups in flight to finish and holds their trajectories, so a resumed run trains the samples
the uninterrupted run trained, sampled by the weights that sampled them there, instead of
generating those prompts again under the restored weights. The groups taken are written down
in the order taken (`taken`, by draw serial) for the run's schedule
(`rlsys.rl.run_schedule`); given a schedule's order (`plan`), the stream takes the groups in
that order instead of the order they finish. An engine that dies is replaced and the groups it
had in flight are generated again (by the weights the trainer holds then), and counted.
"""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass

import numpy as np

from rlsys.actors.group import Call
from rlsys.actors.rollout_worker import RolloutWorker
from rlsys.agents.trajectory import Sampling, Trajectory
from rlsys.data.batching import EpochSampler
from rlsys.data.rl import Prompt
from rlsys.rollout.schedule import ScheduleDiverged
from rlsys.seeds import group_seed


@dataclass
class _Group:
    index: int
    """The prompt's index."""
    serial: int
    """Groups drawn before it: its seed and its place in the draw order."""
    engine: int
    call: Call | None
    """Its call on the engine (sent again to a replaced engine's successor); None for a checkpoint's group."""
    done: list[Trajectory] | None = None
    """Its trajectories once they are known (the call's result; a checkpoint's)."""


class RolloutStream:
    def __init__(self, rollout, prompts: list[Prompt], sampler: EpochSampler, mode: str, max_staleness: int,
                 loop: str, n: int, sampling: Sampling, seed: int, timeout_s: float):
        self.rollout, self.prompts, self.sampler = rollout, prompts, sampler
        self.mode, self.max_staleness = mode, max_staleness
        self.loop, self.n, self.sampling, self.seed = loop, n, sampling, seed
        self.timeout_s = timeout_s
        steps_ahead = 1 if mode == "one_step" else max_staleness
        self.capacity = sampler.batch_size * (1 + steps_ahead)
        self.in_flight: list[_Group] = []
        self.again: list[int] = []
        """Prompts to generate (again) before new ones are drawn: dropped groups, and after a resume
        those that were in flight."""
        self.serial = 0
        self.dropped = 0
        self.regenerated = 0
        """Groups generated again because their engine died."""
        self.taken: list[int] = []
        """The serials of the groups taken (trained or dropped) since the schedule last wrote them."""
        self.plan: list[int] = []
        """The serials of the groups to take next, in order (a followed schedule's); empty: by the clock."""

    def fill(self) -> None:
        """Top the engines up to the stream's capacity of groups in flight."""
        while len(self.in_flight) < self.capacity:
            if not self.again:
                self.again = self.sampler.next_indices()
            self._submit(self.again.pop(0))

    def take(self, count: int, version: int) -> list[list[Trajectory]]:
        """`count` finished groups for the update of policy `version` (its trajectories each),
        dropping and generating again the groups sampled by older weights than the bound allows."""
        taken: list[list[Trajectory]] = []
        while len(taken) < count:
            self.fill()
            for group, trajectories in self._finished(count - len(taken)):
                self.taken.append(group.serial)
                if version - min(min(t.versions, default=version) for t in trajectories) > self.max_staleness:
                    self.dropped += 1
                    self.again.append(group.index)
                else:
                    taken.append(trajectories)
        if self.mode == "full":
            self.fill()  # the engines go on while the trainer updates
        return taken

    def _finished(self, count: int) -> list[tuple[_Group, list[Trajectory]]]:
        """The next `count` finished groups: the first drawn (one_step), the first to finish (full), or
        the next of a followed schedule."""
        if self.plan:
            candidates = self._planned(count)
        else:
            candidates = self.in_flight[:count] if self.mode == "one_step" else self.in_flight
        known = [g for g in candidates if g.done is not None][:count]
        pending = [g for g in candidates if g.done is None]
        finished = self.rollout.first_done([g.call for g in pending], count - len(known), self.timeout_s)
        newly = [g for g in pending if any(g.call is c for c in finished)]
        self._collect(newly)
        chosen = [g for g in candidates if g in known or g in newly]
        self.in_flight = [g for g in self.in_flight if g not in chosen]
        return [(g, g.done) for g in chosen]

    def _planned(self, count: int) -> list[_Group]:
        """The groups a followed schedule takes next (all of them in flight, or the run differs)."""
        serials, self.plan = self.plan[:count], self.plan[count:]
        by_serial = {g.serial: g for g in self.in_flight}
        missing = [serial for serial in serials if serial not in by_serial]
        if missing:
            raise ScheduleDiverged(f"the schedule takes the groups drawn {missing}, which are not in flight")
        return [by_serial[serial] for serial in serials]

    def _collect(self, groups: list[_Group]) -> None:
        """Fetch the trajectories of finished `groups`."""
        if not groups:
            return
        results = self._results(groups)
        for group, result in zip(groups, results):
            group.done = result.unpack({group.index: self.prompts[group.index].ids})

    def _results(self, groups: list[_Group]) -> list:
        """The results of `groups`' calls. An engine that died is replaced (`wait_replacing`: the
        trainer's current weights synced into it) and every group in flight on it generated again,
        with the same seed, counted in `regenerated`."""
        resent = self.rollout.resent
        in_flight = [g.call for g in self.in_flight if g.done is None]
        results = self.rollout.wait_replacing([g.call for g in groups], in_flight)
        self.regenerated += self.rollout.resent - resent
        return results

    def _submit(self, index: int) -> None:
        engine, prompt = self.serial % len(self.rollout.actors), self.prompts[index]
        call = self.rollout.submit_call(engine, RolloutWorker.rollout, [(index, prompt.ids, prompt.row)], self.loop,
                                        self.n, self.sampling, group_seed(self.seed, self.serial))
        self.in_flight.append(_Group(index, self.serial, engine, call))
        self.serial += 1

    def drain(self) -> None:
        """Wait for every group in flight to finish (a sync without partial rollouts)."""
        pending = [g for g in self.in_flight if g.done is None]
        if pending:
            self._results(pending)

    def settle(self) -> None:
        """Wait for every group in flight to finish and keep its trajectories (before a checkpoint)."""
        self._collect([g for g in self.in_flight if g.done is None])

    # -- checkpoints: the sampler's state, the groups in flight (finished), the prompts to generate again --

    def state_dict(self) -> dict:
        """Waits for the groups in flight to finish: they are part of the state."""
        self.settle()
        return {**self.sampler.state_dict(), "again": list(self.again), "serial": self.serial,
                "in_flight": [{"index": g.index, "serial": g.serial, "engine": g.engine,
                               "trajectories": [_saved(t) for t in g.done]} for g in self.in_flight]}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict({"epoch": state["epoch"], "offset": state["offset"]})
        self.again, self.serial = list(state.get("again", [])), state.get("serial", 0)
        self.in_flight = [_Group(g["index"], g["serial"], g["engine"], None, [_restored(t) for t in g["trajectories"]])
                          for g in state.get("in_flight", [])]


def _saved(trajectory: Trajectory) -> dict:
    """A trajectory as JSON holds it (an MoE routing as its bytes, base64), its earlier segments too."""
    fields = {**dataclasses.asdict(trajectory), "earlier": [_saved(segment) for segment in trajectory.earlier]}
    routing = trajectory.routing
    if routing is not None:
        fields["routing"] = {"dtype": str(routing.dtype), "shape": list(routing.shape),
                             "bytes": base64.b64encode(np.ascontiguousarray(routing).tobytes()).decode()}
    return fields


def _restored(fields: dict) -> Trajectory:
    routing = fields.get("routing")
    if routing is not None:
        routing = np.frombuffer(base64.b64decode(routing["bytes"]), routing["dtype"]).reshape(routing["shape"])
    earlier = [_restored(segment) for segment in fields.get("earlier", [])]
    return Trajectory(**{**fields, "routing": routing, "earlier": earlier})
