"""Worker failures during a run: restart inside the same command, or stop with a resume hint.

Like torchrun's `--max-restarts` and Ray Train's `FailureConfig(max_failures)`:
when a worker dies or a collective times out, the attempt's groups are torn
down, built again, and the run resumes from its newest checkpoint, up to
`train.max_restarts` times; after that the failure reaches the CLI (exit code
3) with the step a re-run will resume from.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from rlsys.actors.failures import WorkerFailure
from rlsys.stages.checkpoints import CheckpointDir

log = logging.getLogger(__name__)
T = TypeVar("T")


def run_with_restarts(max_restarts: int, checkpoints: CheckpointDir, attempt: Callable[[int], T]) -> T:
    """`attempt(restarts)` until it returns; it must resume from the newest checkpoint when restarts > 0."""
    restarts = 0
    while True:
        try:
            return attempt(restarts)
        except WorkerFailure as failure:
            step = checkpoints.latest_step()
            if restarts >= max_restarts:
                failure.resume_hint = _resume_hint(checkpoints, step)
                raise
            restarts += 1
            log.warning("%s; restart %d of %d from %s", failure, restarts, max_restarts,
                        f"step {step}" if step else "the start")


def _resume_hint(checkpoints: CheckpointDir, step: int) -> str:
    if not step:
        return "no checkpoint was written yet; re-running the same command starts over"
    return f"checkpoints kept in {checkpoints.root}; re-run the same command to resume from step {step}"
