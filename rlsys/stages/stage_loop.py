"""The loop every training stage runs, written once: the run directory, Ray, the checkpoint
directory, restarts, resume, the tracker, the steps (each logged, a checkpoint when one is due),
the Hugging Face export and the groups' shutdown. A stage supplies a session: its actor groups
for one attempt and what one of its steps does."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from rlsys.actors.cluster import check_nodes_share, ensure_ray
from rlsys.actors.phases import set_phase
from rlsys.config.loader import first_line
from rlsys.config.schema import RLJobConfig, TrainJobConfig
from rlsys.stages.checkpoints import CheckpointDir, save_due
from rlsys.stages.restarts import run_with_restarts
from rlsys.stages.run_dir import HF_MODEL_DIR, prepare_run_dir
from rlsys.tracking.trace import TRACE_FILE, ProcessSpans, gather_spans, span, take_spans, write_trace
from rlsys.tracking.tracker import Tracker

log = logging.getLogger(__name__)


class StageSession(Protocol):
    """One attempt's groups, built by the stage; the loop drives them and shuts them down."""

    def resume(self, force: bool) -> int:
        """Restore the newest checkpoint when the config asks or `force` (a restart); the step it holds."""

    def initial_metrics(self) -> dict[str, float]:
        """What a fresh run logs at step 0 (validation before training), or nothing."""

    def step(self, step: int) -> dict[str, float]:
        """Run one step; its metrics."""

    def samples(self) -> list[dict]:
        """What the model said at the last step, as rows for the trackers (`tracking.log_samples_every`)."""

    def save(self, step: int) -> None:
        """Write a checkpoint of this step."""

    def export(self, hf_dir: str) -> None:
        """Write the final model as a Hugging Face directory."""

    def shutdown(self) -> None:
        """Retire the attempt's actors, dead ones included."""


@dataclass
class StageRun:
    """What the loop did: the step the last attempt resumed from, its metrics at step 0 (a fresh
    run's) and at its last step, how many restarts it took, and where the model went."""

    start_step: int = 0
    initial: dict[str, float] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)
    restarts: int = 0
    hf_dir: str = ""
    started_us: float = field(default_factory=lambda: time.time() * 1e6)
    """When the stage began, on the driver's clock: the timeline's start (`write_run_trace`)."""


def run_stage(cfg: TrainJobConfig | RLJobConfig, stage: str,
              open_session: Callable[[CheckpointDir], StageSession]) -> StageRun:
    """Run `cfg.train.steps` steps of `stage` (cfg: a training job's config) in sessions that
    `open_session` builds, one per attempt: the first, and one more after each restart."""
    config_dict = prepare_run_dir(cfg, stage)
    ensure_ray(cfg.ray)
    check_nodes_share(cfg.output_dir, _model_paths(cfg))
    checkpoints = CheckpointDir(cfg.output_dir, cfg.train.keep_last)
    run = StageRun(hf_dir=os.path.join(cfg.output_dir, HF_MODEL_DIR))

    def attempt(restarts: int) -> StageRun:
        set_phase(f"{stage}: setup")
        with span(f"{stage} restart {restarts}: setup" if restarts else f"{stage} setup"):
            session = open_session(checkpoints)
        try:
            with span("resume"):
                run.start_step, run.restarts = session.resume(force=restarts > 0), restarts
            _steps(cfg, stage, session, checkpoints, config_dict, run)
            set_phase(f"{stage}: export")
            session.export(run.hf_dir)
        finally:
            session.shutdown()
        return run

    return run_with_restarts(cfg.train.max_restarts, checkpoints, attempt)


def _model_paths(cfg: TrainJobConfig | RLJobConfig) -> dict[str, str]:
    """The model directories the run's actors load, by config key: every node must see them."""
    paths = {key: getattr(section, field) for key, section, field in cfg.named_models()}
    return {key: path for key, path in paths.items() if path}


def _steps(cfg: TrainJobConfig | RLJobConfig, stage: str, session: StageSession, checkpoints: CheckpointDir,
           config_dict: dict, run: StageRun) -> None:
    train = cfg.train
    tracker = Tracker(cfg.tracking, cfg.output_dir, config_dict, train.steps, run.start_step, train.log_every)
    try:
        if run.start_step == 0 and (initial := session.initial_metrics()):
            run.initial = initial
            tracker.log(0, initial)
        for step in range(run.start_step + 1, train.steps + 1):
            with span(f"{stage} step {step}", step=step):
                run.last = {**session.step(step), "restarts": run.restarts}
            tracker.log(step, run.last)
            if records := session.samples():
                tracker.log_samples(step, records)
            if save_due(step, train.steps, train.save_every):
                set_phase(f"{stage} step {step}: checkpoint")
                with span("checkpoint"):
                    session.save(step)
    finally:
        tracker.close()
    if cfg.tracking.trace:  # a finished attempt's: a failed one's ranks may not answer
        write_run_trace(cfg.output_dir, run.started_us)


def write_run_trace(output_dir: str, since_us: float) -> None:
    """output_dir/trace.json: the driver's spans, the training ranks' (asked now, which also gives each
    node's clock offset) and Ray's record of every rlsys actor's calls since `since_us`. A timeline that
    cannot be gathered is said in one line; the run goes on."""
    import ray

    started = time.perf_counter()
    try:
        ranks = {name: ray.get_actor(name) for name in sorted(ray.util.list_named_actors())
                 if name.startswith("rlsys/train/")}
        processes, offsets = gather_spans(ranks)
        driver = ProcessSpans("driver", "", take_spans())
        count = write_trace(os.path.join(output_dir, TRACE_FILE), [driver, *processes], ray.timeline(), offsets,
                            since_us)
        log.info("timeline: %s (%d events, gathered in %.1f s; open in ui.perfetto.dev)",
                 os.path.join(output_dir, TRACE_FILE), count, time.perf_counter() - started)
    except Exception as err:  # a dead rank, a cluster that is gone: the timeline is not worth the run
        log.warning("timeline: not written (%s)", first_line(err))
