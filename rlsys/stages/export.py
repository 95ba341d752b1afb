"""`python -m rlsys.run export --checkpoint RUN/checkpoints/step_N --out DIR`: the Hugging Face
directory of any step a run checkpointed, written as the run's own export is at its end (the model's
dtype or `--dtype`, 5 GB shards and their index; with LoRA the merged model and the adapter beside
it), by the run's own layout read back from its config.yaml."""

from __future__ import annotations

import logging
import os
from dataclasses import replace

from rlsys.actors.cluster import ensure_ray
from rlsys.actors.train_group import TrainGroup
from rlsys.actors.train_worker import TrainWorker, build_worker_spec
from rlsys.config.loader import ConfigError, load_config
from rlsys.config.schema import RLJobConfig, TrainJobConfig
from rlsys.stages.checkpoints import DRIVER_STATE, CheckpointDir
from rlsys.stages.run_dir import CONFIG_FILE

log = logging.getLogger(__name__)

TRAINING_STAGES = ("pretrain", "sft", "rm", "rlvr")


def run_export(checkpoint: str, out_dir: str, dtype: str | None = None) -> dict:
    """`dtype`: the weights' dtype in place of the run's `model.export_dtype`."""
    checkpoint = os.path.abspath(checkpoint)
    if not os.path.isfile(os.path.join(checkpoint, DRIVER_STATE)):
        raise ConfigError(f"--checkpoint: {checkpoint} is not a complete checkpoint (it has no {DRIVER_STATE})")
    run_dir = os.path.dirname(os.path.dirname(checkpoint))
    config_path = os.path.join(run_dir, CONFIG_FILE)
    stage = stage_of(config_path)
    cfg = load_config(RLJobConfig if stage == "rlvr" else TrainJobConfig, config_path)
    if dtype is not None:
        cfg = replace(cfg, model=replace(cfg.model, export_dtype=dtype))
    ensure_ray(cfg.ray)
    group = TrainGroup(build_worker_spec(cfg, cfg.train.micro_batch_size, cfg.train.steps, value_head=stage == "rm"),
                       cfg.ray)
    try:
        group.run_all(TrainWorker.load_checkpoint, checkpoint)
        group.run_all(TrainWorker.export_hf, os.path.abspath(out_dir))
    finally:
        group.shutdown()
    step = CheckpointDir.driver_state(checkpoint)["step"]
    log.info("%s: step %d of the %s run in %s", out_dir, step, stage, run_dir)
    return {"stage": stage, "step": step, "hf_model": os.path.abspath(out_dir)}


def stage_of(config_path: str) -> str:
    """The stage a run directory's config.yaml was written by (its first line names the command)."""
    if not os.path.isfile(config_path):
        raise ConfigError(f"--checkpoint: no {CONFIG_FILE} in {os.path.dirname(config_path)}, the run directory "
                          f"a checkpoint lies in (RUN/checkpoints/step_N)")
    with open(config_path) as f:
        words = f.readline().split()
    stage = words[words.index("rlsys.run") + 1] if "rlsys.run" in words[:-1] else ""
    if stage not in TRAINING_STAGES:
        raise ConfigError(f"--checkpoint: {config_path} is not a training stage's config ({stage or 'no stage'})")
    return stage
