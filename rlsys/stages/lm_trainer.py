"""The pretrain / SFT / reward-model loop, run by the driver (the single controller).

Each step: take the next global batch, split it across data-parallel ranks,
have every rank run forward/backward over its micro-batches and step AdamW,
then log. Pretrain and SFT: the loss is the mean NLL over the global batch's
target tokens. `rm`: a batch is preference pairs, a chosen and a rejected row
each, the model has a one-output head in place of the LM head, and the loss is
Bradley-Terry's mean over the pairs (`algorithms.preference_loss`).
"""

from __future__ import annotations

import logging
import time
from typing import Literal

from rlsys.actors.cluster import largest_node_cpus
from rlsys.actors.phases import set_phase
from rlsys.actors.train_group import TrainGroup
from rlsys.actors.train_worker import TrainWorker, build_worker_spec
from rlsys.algorithms.lm_loss import nll_loss
from rlsys.algorithms.preference_loss import bradley_terry_loss
from rlsys.config.schema import TrainJobConfig
from rlsys.config.training import DataConfig
from rlsys.data.batching import EpochSampler, collate, num_targets
from rlsys.data.examples import Example, load_pretrain_examples, load_sft_examples, with_pixels
from rlsys.data.files import DataError, RowStats
from rlsys.data.image_tokens import ImageExpander, image_expander_of
from rlsys.data.preferences import load_preference_pairs
from rlsys.data.tokenizer import load_tokenizer
from rlsys.parallel.dims import ParallelDims
from rlsys.stages.checkpoints import CheckpointDir, restore_training_state, save_training_state
from rlsys.stages.preflight import check_train_job
from rlsys.stages.run_dir import finish_run
from rlsys.stages.stage_loop import run_stage
from rlsys.tracking.trace import span

log = logging.getLogger(__name__)

Stage = Literal["pretrain", "sft", "rm"]

Unit = tuple[Example, ...]
"""What a batch samples: one example, or (rm) a preference pair's chosen and rejected rows."""


def run_lm_training(cfg: TrainJobConfig, stage: Stage) -> dict:
    check_train_job(cfg, stage)
    started = time.time()
    tokenizer = load_tokenizer(cfg.model.path, "model.path")
    expander = image_expander_of(cfg.model.path) if stage == "sft" else None
    examples, row_stats = load_units(cfg.data, stage, tokenizer, expander)
    held_out = load_held_out_pairs(cfg, tokenizer) if stage == "rm" else []
    try:
        sampler = EpochSampler(len(examples), cfg.train.global_batch_size, cfg.seed)
    except ValueError as err:
        raise DataError(f"data.train_files: {err}") from None
    evaluator = None
    if cfg.eval is not None:
        from rlsys.stages.eval import Evaluator, eval_agents, evaluator_loop

        agents = eval_agents(cfg.eval, cfg.tools)
        agents.check_template(tokenizer)
        evaluator = Evaluator(cfg.eval, tokenizer, cfg.seed, cfg.model.path, loop=evaluator_loop(cfg.eval),
                              tools=agents.schemas, response_tokens=cfg.eval.max_response_tokens)
        evaluator.check_engine(cfg.model.path, on_gpu=cfg.ray.gpus_per_worker > 0)
    log.info("%s: %d training %s (%d rows skipped)", stage, len(examples), "pairs" if stage == "rm" else "sequences",
             row_stats.skipped)
    run = run_stage(cfg, stage, lambda checkpoints: LMSession(cfg, stage, examples, sampler, tokenizer.pad_token_id,
                                                              checkpoints, expander, held_out))
    summary = {"stage": stage, "steps": cfg.train.steps, "resumed_from_step": run.start_step,
               "final_loss": run.last.get("train/loss"), "restarts": run.restarts,
               "skipped_rows": row_stats.skipped, "hf_model": run.hf_dir}
    if held_out:
        summary["val_rm_accuracy_before"] = run.initial.get("val/rm_accuracy")
        summary["val_rm_accuracy_after"] = run.last.get("val/rm_accuracy")
    if evaluator is not None:
        from rlsys.stages.eval import evaluate_model

        set_phase(f"{stage}: eval")
        # the training ranks are gone: the engine takes their CPUs, as many as one node has
        cpus = min(cfg.ray.cpus_per_worker * ParallelDims.of(cfg.parallel).world_size, largest_node_cpus())
        summary["eval"] = evaluate_model(run.hf_dir, evaluator, agents, cfg.output_dir, cpus, cfg.ray.gpus_per_worker)
    summary["time_s"] = round(time.time() - started, 1)
    finish_run(cfg.output_dir, summary)
    return summary


def load_units(data: DataConfig, stage: Stage, tokenizer, expander: ImageExpander | None = None
               ) -> tuple[list[Unit], RowStats]:
    if stage == "rm":
        return load_preference_pairs(data, tokenizer)
    if stage == "pretrain":
        examples, stats = load_pretrain_examples(data, tokenizer)
    else:
        examples, stats = load_sft_examples(data, tokenizer, expander)
    return [(example,) for example in examples], stats


def load_held_out_pairs(cfg: TrainJobConfig, tokenizer) -> list[Unit]:
    """`data.val_files`' preference pairs, as many as split evenly over the data-parallel ranks (a
    pair stays on one rank, and every rank runs as many forwards)."""
    if not cfg.data.val_files:
        return []
    pairs, _ = load_preference_pairs(cfg.data, tokenizer, cfg.data.val_files)
    dp = ParallelDims.of(cfg.parallel).dp_size
    kept = pairs[:len(pairs) - len(pairs) % dp]
    if not kept:
        raise DataError(f"data.val_files: {len(pairs)} usable pairs, fewer than the {dp} data-parallel ranks")
    log.info("rm: %d held-out pairs (%d left out to split evenly over %d ranks)", len(kept), len(pairs) - len(kept), dp)
    return kept


class LMSession:
    """One attempt of a pretrain, SFT or reward-model stage (`run_stage`): the training group over
    the examples, and (rm) the held-out pairs it scores."""

    def __init__(self, cfg: TrainJobConfig, stage: Stage, examples: list[Unit], sampler: EpochSampler,
                 pad_id: int, checkpoints: CheckpointDir, expander: ImageExpander | None = None,
                 held_out: list[Unit] | None = None):
        self.cfg, self.stage, self.examples, self.sampler, self.pad_id = cfg, stage, examples, sampler, pad_id
        self.expander, self.held_out = expander, held_out or []
        self.checkpoints = checkpoints
        rows = len(examples[0])  # a micro-batch of micro_batch_size units
        self.group = TrainGroup(build_worker_spec(cfg, rows * cfg.train.micro_batch_size, cfg.train.steps,
                                                  value_head=stage == "rm"), cfg.ray)

    def resume(self, force: bool) -> int:
        resume = self.cfg.train.resume or force
        return restore_training_state(self.checkpoints, self.group, self.sampler) if resume else 0

    def initial_metrics(self) -> dict[str, float]:
        return self.validate(0)

    def step(self, step: int) -> dict[str, float]:
        set_phase(f"{self.stage} step {step}: train")
        metrics = train_step(self.group, self.examples, self.sampler, self.pad_id, self.expander)
        every = self.cfg.train.val_every
        if step == self.cfg.train.steps or (every and step % every == 0):
            metrics.update(self.validate(step))
        return metrics

    def validate(self, step: int) -> dict[str, float]:
        if not self.held_out:
            return {}
        set_phase(f"{self.stage} step {step}: validate")
        with span("validate"):
            return score_pairs(self.group, self.held_out, self.cfg.train.global_batch_size, self.pad_id)

    def samples(self) -> list[dict]:
        return []

    def save(self, step: int) -> None:
        save_training_state(self.checkpoints, step, self.group, self.sampler)

    def export(self, hf_dir: str) -> None:
        self.group.run_all(TrainWorker.export_hf, hf_dir)

    def shutdown(self) -> None:
        self.group.shutdown()


def score_pairs(group: TrainGroup, pairs: list[Unit], pairs_per_batch: int, pad_id: int) -> dict[str, float]:
    """Bradley-Terry's loss, pair accuracy and mean margin over held-out `pairs` (a multiple of the
    data-parallel size), in batches of at most `pairs_per_batch` pairs, without a step."""
    loss_fn = bradley_terry_loss(len(pairs))
    totals: dict[str, float] = {}
    for start in range(0, len(pairs), pairs_per_batch):
        batch = collate([example for pair in pairs[start:start + pairs_per_batch] for example in pair], pad_id)
        metrics = group.run_data_parallel(TrainWorker.evaluate, batch, loss_fn=loss_fn)[0]
        for name, value in metrics.items():
            totals[name] = totals.get(name, 0.0) + value
    return {"val/loss": totals["loss"], "val/rm_accuracy": totals["rm/accuracy"], "val/rm_margin": totals["rm/margin"]}


def train_step(group: TrainGroup, examples: list[Unit], sampler: EpochSampler, pad_id: int,
               expander: ImageExpander | None = None) -> dict:
    """One step; `expander` processes a vision-language model's pictures of the step's examples."""
    started = time.perf_counter()
    units = [examples[i] for i in sampler.next_indices()]
    batch = collate(with_pixels([example for unit in units for example in unit], expander), pad_id)
    loss_fn = bradley_terry_loss(len(units)) if len(units[0]) == 2 else nll_loss(num_targets(batch))
    step, _ = group.run_data_parallel(TrainWorker.train_step, batch, loss_fn=loss_fn)[0]
    elapsed = time.perf_counter() - started
    tokens = int(batch["attention_mask"].sum())
    return {
        "train/loss": step["loss"],
        "train/grad_norm": step["grad_norm"],
        "train/lr": step["lr"],
        "throughput/tokens": tokens,
        "throughput/tokens_per_s": tokens / elapsed,
        "time/step_s": elapsed,
        **{name: value for name, value in step.items() if name.startswith(("router/", "rm/", "perf/"))},
        **group.memory_peaks(),
    }
