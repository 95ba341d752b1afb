"""Asynchronous RL: prompt groups generated ahead of training.

A group is one prompt's `rollout.n` trajectories, one call on one engine. The stream keeps
groups in flight on the engines (`train.async_mode: one_step`: this step's and the next
step's; `full`: 1 + `train.max_staleness` steps' worth), so the engines generate while the
trainer updates. A step takes `train.prompts_per_step` finished groups: in the order they
were drawn (one_step), or in the order they finish (full). A group holding a token more
than `max_staleness` policy versions older than the policy being updated is dropped, counted,
and its prompt generated again: no prompt is lost or trained twice.

Seeds follow the order groups are drawn in, so the samples do not depend on timing; which
weights sampled each token does (the engines' speed against the trainer's), so an
asynchronous run is not reproduced token for token by a resumed one. A resumed run generates
again the prompts that were in flight when its checkpoint was written.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray

from rlsys.actors.failures import WorkerFailure
from rlsys.actors.phases import current_phase
from rlsys.agents.trajectory import Sampling, Trajectory
from rlsys.data.batching import EpochSampler
from rlsys.data.rl import Prompt


@dataclass
class _Group:
    index: int
    """The prompt's index."""
    serial: int
    """Groups drawn before it: its seed and its place in the draw order."""
    engine: int
    ref: ray.ObjectRef


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
                if version - min(min(t.versions, default=version) for t in trajectories) > self.max_staleness:
                    self.dropped += 1
                    self.again.append(group.index)
                else:
                    taken.append(trajectories)
        if self.mode == "full":
            self.fill()  # the engines go on while the trainer updates
        return taken

    def _finished(self, count: int) -> list[tuple[_Group, list[Trajectory]]]:
        """The next `count` finished groups: the first drawn (one_step), or the first to finish (full)."""
        candidates = self.in_flight[:count] if self.mode == "one_step" else self.in_flight
        done, _ = ray.wait([g.ref for g in candidates], num_returns=count, timeout=self.timeout_s)
        if len(done) < count:
            late = next(g for g in candidates if g.ref not in set(done))
            raise WorkerFailure(self.rollout.names[late.engine], f"returned no rollout within {self.timeout_s:g} s",
                                current_phase())
        done_refs = set(done)
        chosen = [g for g in candidates if g.ref in done_refs]
        self.in_flight = [g for g in self.in_flight if g not in chosen]
        results = self.rollout.wait([g.ref for g in chosen], [g.engine for g in chosen])
        prompt_ids = {g.index: self.prompts[g.index].ids for g in chosen}
        return [(g, result.unpack(prompt_ids)) for g, result in zip(chosen, results)]

    def _submit(self, index: int) -> None:
        engine = self.serial % len(self.rollout.actors)
        prompt = self.prompts[index]
        ref = self.rollout.submit(engine, "rollout", [(index, prompt.ids, prompt.row)], self.loop, self.n,
                                  self.sampling, self.seed * 100_003 + self.serial)
        self.in_flight.append(_Group(index, self.serial, engine, ref))
        self.serial += 1

    def drain(self) -> None:
        """Wait for every group in flight to finish (a sync without partial rollouts)."""
        if self.in_flight:
            self.rollout.wait([g.ref for g in self.in_flight], [g.engine for g in self.in_flight])

    # -- checkpoints: the sampler's state, and the prompts to generate (again) first --

    def state_dict(self) -> dict:
        return {**self.sampler.state_dict(), "again": self.again + [g.index for g in self.in_flight],
                "serial": self.serial}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict({"epoch": state["epoch"], "offset": state["offset"]})
        self.again, self.serial, self.in_flight = list(state.get("again", [])), state.get("serial", 0), []
