"""An asynchronous run's schedule: what decided its tokens besides the weights and the seeds.

Under asynchronous RL the engines' steps interleave with the driver's calls, the tool results
and the syncs by the clock, and in `full` mode a step trains on the groups that finished first.
`schedule.jsonl`, beside `metrics.jsonl`, holds one line per training step (and one more at a
checkpoint): the groups the stream took in that step, in the order taken (`taken`, by draw
serial), and each engine's events (`engines`: the requests its steps added, the steps its syncs
landed before; `rlsys.rollout.schedule`). `train.replay: PATH` runs a job following another
run's schedule instead of the clock, so it repeats that run token for token; a checkpoint
holds each engine's step count, so a resumed run continues its schedule, and one that replays
continues following.
"""

from __future__ import annotations

import json
import os

from rlsys.actors.rollout_worker import RolloutWorker
from rlsys.config.loader import ConfigError
from rlsys.config.schema import RLJobConfig

SCHEDULE_FILE = "schedule.jsonl"


def read_schedule(path: str) -> list[dict]:
    """The lines of a recorded schedule (`path`: the file, or the run directory holding it)."""
    if os.path.isdir(path):
        path = os.path.join(path, SCHEDULE_FILE)
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def check_replay(job: RLJobConfig) -> None:
    """A schedule to follow (`train.replay`): an asynchronous run's, for as many engines."""
    if job.train.replay is None:
        return
    if job.train.async_mode == "off":
        raise ConfigError("train.replay: a synchronous run repeats itself without a schedule; set train.async_mode")
    own = os.path.join(job.output_dir, SCHEDULE_FILE)
    if os.path.abspath(job.train.replay) in {os.path.abspath(job.output_dir), os.path.abspath(own)}:
        raise ConfigError(f"train.replay: {job.train.replay} is this run's own schedule, which it writes again; "
                          "give the recorded run's and another output_dir")
    try:
        lines = read_schedule(job.train.replay)
    except (OSError, ValueError) as err:
        raise ConfigError(f"train.replay: cannot read a schedule from {job.train.replay} ({err})") from None
    engines = {len(line.get("engines", [])) for line in lines}
    if engines - {job.rollout.num_engines}:
        raise ConfigError(f"train.replay: {job.train.replay} was recorded with {sorted(engines)} engines; this job "
                          f"has rollout.num_engines={job.rollout.num_engines}")


class RunSchedule:
    def __init__(self, output_dir: str, rollout, stream, replay: str | None, record: bool):
        """`rollout`: the engines (`RolloutGroup`); `stream`: the `RolloutStream` whose takes are
        recorded (and, replaying, dictated); `replay`: a schedule to follow; `record`: write this
        run's."""
        self.path = os.path.join(output_dir, SCHEDULE_FILE)
        self.rollout, self.stream, self.record = rollout, stream, record
        self.followed = read_schedule(replay) if replay else []
        self.engine_steps = [0] * len(rollout.actors)

    def start(self, step: int) -> None:
        """Begin after `step` (0: a fresh run; else the checkpoint's, whose engine step counts
        `load_state_dict` brought): this run's record keeps what precedes it, the engines count on
        from their step counts, and with a schedule to follow both follow it from there."""
        if self.record:
            self._truncate(step)
        after = [line for line in self.followed if line["step"] > step]  # the earlier lines precede the checkpoint
        engines = range(len(self.engine_steps))
        self.rollout.wait([self.rollout.submit(index, RolloutWorker.follow_schedule,
                                               [event for line in after for event in line["engines"][index]],
                                               self.engine_steps[index]) for index in engines], list(engines))
        self.stream.plan = [serial for line in after for serial in line["taken"]]

    def write(self, step: int) -> None:
        """Append what happened since the last line: the stream's takes and the engines' events."""
        reports = self.rollout.run_all(RolloutWorker.schedule)
        self.engine_steps = [steps for steps, _ in reports]
        taken, self.stream.taken = self.stream.taken, []
        if self.record:
            line = {"step": step, "taken": taken, "engines": [events for _, events in reports]}
            with open(self.path, "a") as f:
                f.write(_json_line(line))

    def state_dict(self) -> dict:
        return {"engine_steps": list(self.engine_steps)}

    def load_state_dict(self, state: dict) -> None:
        self.engine_steps = list(state.get("engine_steps", self.engine_steps))

    def _truncate(self, step: int) -> None:
        """Keep the lines of steps up to `step` (a resumed run writes the later ones again)."""
        kept = [line for line in read_schedule(self.path) if line["step"] <= step] if os.path.exists(self.path) else []
        with open(self.path, "w") as f:
            f.writelines(_json_line(line) for line in kept)


def _json_line(line: dict) -> str:
    return json.dumps(line, separators=(",", ":")) + "\n"
