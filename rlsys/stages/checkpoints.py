"""Checkpoint directories under output_dir/checkpoints.

A checkpoint is written into `step_N.partial/` and renamed to `step_N/` only
once every rank and the driver have written their part, so a crash mid-save
never leaves a checkpoint that looks complete.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable

from rlsys.actors.train_worker import TrainWorker

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")
DRIVER_STATE = "trainer_state.json"


class CheckpointDir:
    def __init__(self, output_dir: str, keep_last: int):
        self.root = os.path.join(output_dir, "checkpoints")
        self.keep_last = keep_last

    def latest(self) -> str | None:
        step = self.latest_step()
        return os.path.join(self.root, f"step_{step:06d}") if step else None

    def latest_step(self) -> int:
        """The newest complete checkpoint's step (0 when there is none)."""
        steps = self._complete_steps()
        return steps[-1] if steps else 0

    def save(self, step: int, save_ranks: Callable[[str], None], driver_state: dict) -> str:
        final = os.path.join(self.root, f"step_{step:06d}")
        partial = final + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        save_ranks(partial)
        with open(os.path.join(partial, DRIVER_STATE), "w") as f:
            json.dump({"step": step, **driver_state}, f)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        self._prune()
        return final

    @staticmethod
    def driver_state(path: str) -> dict:
        with open(os.path.join(path, DRIVER_STATE)) as f:
            return json.load(f)

    def _complete_steps(self) -> list[int]:
        if not os.path.isdir(self.root):
            return []
        matches = (_STEP_DIR.match(name) for name in os.listdir(self.root))
        return sorted(int(m.group(1)) for m in matches
                      if m and os.path.isfile(os.path.join(self.root, m.group(0), DRIVER_STATE)))

    def _prune(self) -> None:
        for step in self._complete_steps()[: -self.keep_last]:
            shutil.rmtree(os.path.join(self.root, f"step_{step:06d}"), ignore_errors=True)


def save_due(step: int, total_steps: int, save_every: int) -> bool:
    return step == total_steps or bool(save_every and step % save_every == 0)


def save_training_state(checkpoints: CheckpointDir, step: int, group, sampler, driver: dict | None = None) -> str:
    """Every rank's model/optimizer/scheduler/RNG, the driver's data position and the state of
    any other `driver` object (state_dict / load_state_dict), by name."""
    states = {name: obj.state_dict() for name, obj in (driver or {}).items()}
    return checkpoints.save(step, lambda path: group.run_all(TrainWorker.save_checkpoint, path),
                            {"sampler": sampler.state_dict(), **states})


def restore_training_state(checkpoints: CheckpointDir, group, sampler, driver: dict | None = None) -> int:
    """Load the newest complete checkpoint into `group`, `sampler` and the `driver` objects;
    its step, or 0 (and the sampler back at its start) when there is none."""
    path = checkpoints.latest()
    if path is None:
        sampler.load_state_dict({"epoch": 0, "offset": 0})
        return 0
    state = CheckpointDir.driver_state(path)
    group.run_all(TrainWorker.load_checkpoint, path)
    sampler.load_state_dict(state["sampler"])
    for name, obj in (driver or {}).items():
        if name in state:
            obj.load_state_dict(state[name])
    log.info("resumed from %s (step %d)", path, state["step"])
    return int(state["step"])
