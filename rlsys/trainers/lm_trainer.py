"""The pretrain / SFT loop, run by the driver (the single controller).

Each step: take the next global batch, split it across data-parallel ranks,
have every rank run forward/backward over its micro-batches and step AdamW,
then log. The loss is the mean NLL over the global batch's target tokens.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Literal

from rlsys.actors.cluster import ensure_ray
from rlsys.actors.phases import set_phase
from rlsys.actors.train_group import TrainGroup
from rlsys.actors.train_worker import build_worker_spec
from rlsys.algorithms.lm_loss import nll_loss
from rlsys.config.schema import TrainJobConfig
from rlsys.data.batching import EpochSampler, collate, num_targets
from rlsys.data.examples import Example, load_pretrain_examples, load_sft_examples
from rlsys.data.files import DataError
from rlsys.data.tokenizer import load_tokenizer
from rlsys.parallel.dims import ParallelDims
from rlsys.tracking.tracker import Tracker
from rlsys.trainers.checkpoints import CheckpointDir, restore_training_state, save_due, save_training_state
from rlsys.trainers.preflight import check_train_job
from rlsys.trainers.restarts import run_with_restarts
from rlsys.trainers.run_dir import HF_MODEL_DIR, finish_run, prepare_run_dir

log = logging.getLogger(__name__)

Stage = Literal["pretrain", "sft"]


def run_lm_training(cfg: TrainJobConfig, stage: Stage) -> dict:
    check_train_job(cfg)
    started = time.time()
    tokenizer = load_tokenizer(cfg.model.path, "model.path")
    examples, row_stats = (load_pretrain_examples if stage == "pretrain" else load_sft_examples)(cfg.data, tokenizer)
    try:
        sampler = EpochSampler(len(examples), cfg.train.global_batch_size, cfg.seed)
    except ValueError as err:
        raise DataError(f"data.train_files: {err}") from None
    evaluator = None
    if cfg.eval is not None:
        from rlsys.trainers.eval import Evaluator, eval_agents, evaluator_loop

        agents = eval_agents(cfg.eval, cfg.tools)
        agents.check_template(tokenizer)
        evaluator = Evaluator(cfg.eval, tokenizer, cfg.seed, cfg.model.path, loop=evaluator_loop(cfg.eval),
                              tools=agents.schemas, response_tokens=cfg.eval.max_response_tokens)
    log.info("%s: %d training sequences (%d rows skipped)", stage, len(examples), row_stats.skipped)
    config_dict = prepare_run_dir(cfg, stage)
    ensure_ray(cfg.ray)
    checkpoints = CheckpointDir(cfg.output_dir, cfg.train.keep_last)

    def attempt(restarts: int) -> tuple[int, dict]:
        return _train(cfg, stage, examples, sampler, tokenizer.pad_token_id, checkpoints, config_dict, restarts)

    start_step, last = run_with_restarts(cfg.train.max_restarts, checkpoints, attempt)
    hf_dir = os.path.join(cfg.output_dir, HF_MODEL_DIR)
    summary = {"stage": stage, "steps": cfg.train.steps, "resumed_from_step": start_step,
               "final_loss": last.get("loss"), "restarts": last.get("restarts", 0),
               "skipped_rows": row_stats.skipped, "hf_model": hf_dir}
    if evaluator is not None:
        from rlsys.trainers.eval import evaluate_model

        set_phase(f"{stage}: eval")
        cpus = cfg.ray.cpus_per_worker * ParallelDims.of(cfg.parallel).world_size
        summary["eval"] = evaluate_model(hf_dir, evaluator, agents, cfg.output_dir, cpus, cfg.ray.gpus_per_worker)
    summary["time_s"] = round(time.time() - started, 1)
    finish_run(cfg.output_dir, summary)
    return summary


def _train(cfg: TrainJobConfig, stage: Stage, examples: list[Example], sampler: EpochSampler, pad_id: int,
           checkpoints: CheckpointDir, config_dict: dict, restarts: int) -> tuple[int, dict]:
    """One attempt: build the group, resume, train to the last step and export.
    Returns the step it started from and the last step's metrics."""
    set_phase(f"{stage}: setup")
    group = TrainGroup(build_worker_spec(cfg, cfg.train.micro_batch_size, cfg.train.steps), cfg.ray)
    try:
        resume = cfg.train.resume or restarts > 0
        start_step = restore_training_state(checkpoints, group, sampler) if resume else 0
        tracker = Tracker(cfg.tracking, cfg.output_dir, config_dict, cfg.train.steps, start_step, cfg.train.log_every)
        last = {}
        try:
            for step in range(start_step + 1, cfg.train.steps + 1):
                set_phase(f"{stage} step {step}: train")
                last = {**train_step(group, examples, sampler, pad_id), "restarts": restarts}
                tracker.log(step, last)
                if save_due(step, cfg.train.steps, cfg.train.save_every):
                    set_phase(f"{stage} step {step}: checkpoint")
                    save_training_state(checkpoints, step, group, sampler)
        finally:
            tracker.close()
        set_phase(f"{stage}: export")
        group.run_all("export_hf", os.path.join(cfg.output_dir, HF_MODEL_DIR))
    finally:
        group.shutdown()
    return start_step, last


def train_step(group: TrainGroup, examples: list[Example], sampler: EpochSampler, pad_id: int) -> dict:
    started = time.perf_counter()
    batch = collate([examples[i] for i in sampler.next_indices()], pad_id)
    step, _ = group.run_data_parallel("train_step", batch, loss_fn=nll_loss(num_targets(batch)))[0]
    elapsed = time.perf_counter() - started
    tokens = int(batch["attention_mask"].sum())
    return {
        "loss": step["loss"],
        "grad_norm": step["grad_norm"],
        "lr": step["lr"],
        "tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "step_time_s": elapsed,
        **{name: value for name, value in step.items() if name.startswith("router/")},  # an MoE model's
    }
