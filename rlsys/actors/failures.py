"""Worker failures: a dead actor or a collective that timed out, named by role and rank.

Every driver call that waits on actors goes through `wait_all`, which returns
as soon as a call fails instead of waiting for the survivors (they may be
blocked in a collective with the dead rank). A failure becomes `WorkerFailure`,
which the trainers answer with a restart (`train.max_restarts`) or the CLI
with one line and exit code 3; any other error stays a bug with its traceback.
A dead worker outside the training group is first replaced alone where the
run allows it (`WorkerReplacements`, `rlsys.actors.group.ActorGroup.wait_replacing`).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray

from rlsys.actors.cluster import log_file_of, name_of
from rlsys.actors.phases import current_phase

log = logging.getLogger(__name__)

# Messages of torch.distributed errors that mean a peer is gone or a collective hung.
_COMMUNICATION_ERRORS = ("DistBackendError", "Connection closed by peer", "Connection reset by peer",
                         "timed out", "Timed out", "Broken pipe", "NCCL error")
_EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Exit)\b.*:")
_GRACE_S = 5.0
"""After the first failure, how long to wait for the other calls: a dead rank's own error
arrives within this, so the report names the rank that died, not a peer that lost it."""


class WorkerFailure(RuntimeError):
    resume_hint: str = ""
    """What a re-run will do (set by `rlsys.stages.restarts` when no restart is left)."""

    def __init__(self, worker: str, reason: str, phase: str, actor_id: str | None = None,
                 replaceable: bool = False, hung: bool = False):
        """`actor_id`: the dead actor's, where known (a name outlives the actor a replacement succeeds);
        `replaceable`: the worker itself died or hung (not a peer's error that reached it); `hung`: its
        call ran past its limit."""
        self.worker, self.reason, self.phase, self.actor_id = worker, reason, phase, actor_id
        self.replaceable, self.hung = replaceable, hung
        super().__init__(f"{describe(worker)} {reason} during {phase}")


class WorkerReplacements:
    """How many dead workers a run may still replace in place (`train.max_worker_restarts`),
    shared by its groups of rollout engines, reward workers and served-model engines. A training
    rank is never replaced this way: its death restarts the run from a checkpoint."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0

    def allow(self, failure: WorkerFailure) -> bool:
        """Count one replacement for `failure`, or False when none is left."""
        if self.used >= self.limit:
            return False
        self.used += 1
        log.warning("%s; replacing it (%d of %d worker restarts)", failure, self.used, self.limit)
        return True


def describe(name: str) -> str:
    """rlsys/train/1 -> 'train rank 1 (rlsys/train/1)'; rollout and reward workers by index."""
    parts = name.split("/")
    if len(parts) != 3:
        return name
    what = "rank" if parts[1] == "train" else "worker"
    return f"{parts[1]} {what} {parts[2]} ({name})"


@dataclass(frozen=True)
class CallLimit:
    """How long a call may run before its worker counts as hung, and the setting that says so."""

    seconds: float
    key: str


def wait_all(refs: list, names: list[str] | None = None, straggler_timeout_s: float | None = None,
             limit: CallLimit | None = None, on_result: Callable[[int], None] | None = None) -> list:
    """`ray.get(refs)`, but a failed call ends the wait early, as a WorkerFailure when a
    worker died or lost its peers. With `straggler_timeout_s`, a call still running that
    long after another call of the same group returned is a hang (a rank stopped after
    its last collective leaves no peer waiting to time out); with `limit`, so is a call still
    running that long after the wait began. `names` (the actor of each call) lets the report
    name the worker; `on_result` is told the index of each call that returns, as it does."""
    results: dict[int, object] = {}
    errors: list[Exception] = []
    index = {ref: i for i, ref in enumerate(refs)}
    pending = list(refs)
    deadline = time.monotonic() + limit.seconds if limit else None
    while pending and not errors:
        straggler = straggler_timeout_s if results else None
        remaining = max(0.0, deadline - time.monotonic()) if deadline is not None else None
        timeout = min((t for t in (straggler, remaining) if t is not None), default=None)
        done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not done:
            worker = names[index[pending[0]]] if names else "a worker"
            # the limit that bound this wait decides (ray.wait may return a hair before its timeout)
            if remaining is not None and (straggler is None or remaining <= straggler):
                raise WorkerFailure(worker, f"did not answer within {limit.seconds:g} s ({limit.key})",
                                    current_phase(), replaceable=True, hung=True)
            raise WorkerFailure(worker, f"did not answer within {timeout:g} s of its peers", current_phase())
        _collect(done, index, results, errors)
        if on_result is not None and not errors:
            on_result(index[done[0]])
    if errors:
        late, _ = ray.wait(pending, num_returns=len(pending), timeout=_GRACE_S)
        _collect(late, index, results, errors)
        raise _as_failure([(err, names[i] if names else None) for i, err in errors])
    return [results[i] for i in range(len(refs))]


def _collect(done: list, index: dict, results: dict, errors: list) -> None:
    for ref in done:
        try:
            results[index[ref]] = ray.get(ref)
        except Exception as err:  # the call's own error, judged by _as_failure
            errors.append((index[ref], err))


def _as_failure(errors: list[tuple[Exception, str | None]]) -> Exception:
    """The most telling error: an actor's death first, then a communication error, else the
    first error unchanged (a bug keeps its traceback). A death is named by the actor that
    died, which may not be the one called (an argument of the call came from it)."""
    for err, called in errors:
        if isinstance(err, ray.exceptions.RayActorError):
            worker = name_of(err.actor_id) or called or "a worker"
            cause = _cause_of_death(err, worker)
            return WorkerFailure(worker, f"died ({cause})" if cause else "died", current_phase(), err.actor_id,
                                 replaceable=True)
    for err, called in errors:
        text = str(err)
        if isinstance(err, ray.exceptions.RayTaskError) and any(m in text for m in _COMMUNICATION_ERRORS):
            worker = called or name_of(getattr(err, "actor_id", None)) or "a worker"
            timed_out = "timed out" in text.lower()
            reason = "timed out in a collective" if timed_out else "lost its peers"
            return WorkerFailure(worker, f"{reason} ({_last_line(text)})", current_phase())
    return errors[0][0]


def _cause_of_death(err: ray.exceptions.RayActorError, worker: str) -> str:
    """What killed an actor, where it can be told: the error its constructor raised (an engine that
    could not start), else during set-up the last error its log holds (a process that exited while
    building its engine); empty otherwise (a process killed from outside names no cause)."""
    if err.actor_init_failed:
        return _last_line(err.error_msg)
    return last_error_line(log_file_of(worker)) if current_phase().endswith("setup") else ""


def last_error_line(path: str | None) -> str:
    """The last line of the log at `path` that names an exception (`SomethingError: ...`); empty when none."""
    if not path or not os.path.isfile(path):
        return ""
    with open(path, errors="replace") as f:
        lines = f.readlines()[-200:]
    errors = [line.strip() for line in lines if _EXCEPTION_LINE.match(line.strip())]
    return errors[-1][:200] if errors else ""


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else text
