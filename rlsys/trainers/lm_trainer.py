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

from transformers import AutoTokenizer

from rlsys.actors.cluster import ensure_ray
from rlsys.actors.train_worker import build_worker_spec
from rlsys.actors.worker_group import TrainGroup
from rlsys.config.checks import check_train_job
from rlsys.config.schema import TrainJobConfig
from rlsys.data.batching import EpochSampler, collate, num_targets
from rlsys.data.examples import Example, load_pretrain_examples, load_sft_examples
from rlsys.data.files import DataError
from rlsys.trainers.checkpoints import CheckpointDir, restore_training_state, save_due, save_training_state
from rlsys.trainers.run_dir import HF_MODEL_DIR, finish_run, prepare_run_dir
from rlsys.tracking.phases import set_phase
from rlsys.tracking.tracker import Tracker

log = logging.getLogger(__name__)

Stage = Literal["pretrain", "sft"]


def run_lm_training(cfg: TrainJobConfig, stage: Stage) -> dict:
    check_train_job(cfg)
    started = time.time()
    config_dict = prepare_run_dir(cfg, stage)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    examples, row_stats = (load_pretrain_examples if stage == "pretrain" else load_sft_examples)(cfg.data, tokenizer)
    try:
        sampler = EpochSampler(len(examples), cfg.train.global_batch_size, cfg.seed)
    except ValueError as err:
        raise DataError(f"data.train_files: {err}") from None
    log.info("%s: %d training sequences (%d rows skipped)", stage, len(examples), row_stats.skipped)

    ensure_ray(cfg.ray)
    group = TrainGroup(build_worker_spec(cfg, cfg.train.micro_batch_size, cfg.train.steps), cfg.ray)
    try:
        checkpoints = CheckpointDir(cfg.output_dir, cfg.train.keep_last)
        start_step = restore_training_state(checkpoints, group, sampler) if cfg.train.resume else 0
        tracker = Tracker(cfg.tracking, cfg.output_dir, config_dict, cfg.train.steps, start_step, cfg.train.log_every)
        last = {}
        try:
            for step in range(start_step + 1, cfg.train.steps + 1):
                set_phase(f"{stage} step {step}: train")
                last = train_step(group, examples, sampler, tokenizer.pad_token_id)
                tracker.log(step, last)
                if save_due(step, cfg.train.steps, cfg.train.save_every):
                    set_phase(f"{stage} step {step}: checkpoint")
                    save_training_state(checkpoints, step, group, sampler)
        finally:
            tracker.close()
        hf_dir = os.path.join(cfg.output_dir, HF_MODEL_DIR)
        set_phase(f"{stage}: export")
        group.run_all("export_hf", hf_dir)
    finally:
        group.shutdown()

    summary = {"stage": stage, "steps": cfg.train.steps, "resumed_from_step": start_step,
               "final_loss": last.get("loss"),
               "skipped_rows": row_stats.skipped, "hf_model": hf_dir}
    if cfg.eval is not None:
        from rlsys.eval import evaluate_model

        summary["eval"] = evaluate_model(hf_dir, cfg.eval, cfg.output_dir, cfg.seed)
    summary["time_s"] = round(time.time() - started, 1)
    finish_run(cfg.output_dir, summary)
    return summary


def train_step(group: TrainGroup, examples: list[Example], sampler: EpochSampler, pad_id: int) -> dict:
    started = time.perf_counter()
    batch = collate([examples[i] for i in sampler.next_indices()], pad_id)
    per_rank = group.run_data_parallel("train_step", batch, num_global_targets=num_targets(batch))
    elapsed = time.perf_counter() - started
    tokens = int(batch["attention_mask"].sum())
    return {
        "loss": sum(r["loss"] for r in per_rank),
        "grad_norm": per_rank[0]["grad_norm"],
        "lr": per_rank[0]["lr"],
        "tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "step_time_s": elapsed,
    }
