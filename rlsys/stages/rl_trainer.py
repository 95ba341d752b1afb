"""The RLVR stage: the driver's groups for a run (training ranks, rollout engines, reward workers, tools,
served models, the weight sync), its step (`rlsys.rl.step`), validation, checkpoints and resume."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from rlsys.actors.cluster import gpu_shares
from rlsys.actors.failures import WorkerReplacements
from rlsys.actors.phases import set_phase
from rlsys.actors.reward_pool import RewardPool
from rlsys.actors.rollout_group import RolloutGroup
from rlsys.actors.served_models import ServedModelGroup
from rlsys.actors.train_group import TrainGroup
from rlsys.actors.train_worker import TrainWorker, build_worker_spec
from rlsys.config.schema import RLJobConfig
from rlsys.data.batching import EpochSampler
from rlsys.rl.adapter_sync import AdapterSync
from rlsys.rl.extension import StepGroups
from rlsys.rl.features import features_of
from rlsys.rl.passes import needs_reference
from rlsys.rl.rollout_stream import RolloutStream
from rlsys.rl.run_schedule import RunSchedule
from rlsys.rl.step import RLStep
from rlsys.rl.update import updates_per_step
from rlsys.rl.weight_sync import WeightSync
from rlsys.rollout.adapters import AdapterSpec
from rlsys.rollout.vllm_engine import synced_weight_dtype
from rlsys.stages.checkpoints import CheckpointDir, restore_training_state, save_training_state
from rlsys.stages.preflight import check_rl_job
from rlsys.stages.rl_setup import RLData, colocated_engines, load_rl_data, teacher_in_trainer, teacher_length
from rlsys.stages.run_dir import finish_run, logged_metric
from rlsys.stages.stage_loop import run_stage
from rlsys.tracking.trace import span

log = logging.getLogger(__name__)


class RLVRTrainer:
    def __init__(self, cfg: RLJobConfig, data: RLData | None = None, checkpoints: CheckpointDir | None = None):
        """Builds the groups on the running Ray cluster; `checkpoints`: the run's (`run_stage`'s)."""
        self.cfg = cfg
        data = data or load_rl_data(cfg)
        self.tokenizer, self.prompts, self.engine_length = data.tokenizer, data.prompts, data.engine_length
        self.evaluator, self.agents, self.expander = data.evaluator, data.agents, data.expander
        self.sampler = EpochSampler(len(self.prompts), cfg.train.prompts_per_step, cfg.seed)
        self.features = features_of(cfg)
        self.checkpoints = checkpoints or CheckpointDir(cfg.output_dir, cfg.train.keep_last)
        self.train_group = self.rollout_group = self.tools = self.stream = self.schedule = self.teacher = None
        self.replacements = WorkerReplacements(cfg.train.max_worker_restarts)
        """Dead rollout engines, reward workers and served-model engines replaced so far, and the bound."""
        self.reward_pool = RewardPool(cfg.reward, replacements=self.replacements)
        try:
            self.tools = self.agents.start_tools()
            spec = build_worker_spec(cfg, cfg.train.micro_batch_size, cfg.train.steps * updates_per_step(cfg),
                                     with_reference=needs_reference(cfg),
                                     critic=cfg.critic if cfg.algorithm.adv_estimator == "gae" else None,
                                     teacher=teacher_in_trainer(cfg.algorithm.distill))
            train_gpus, engine_gpus = gpu_shares(cfg.ray.gpus_per_worker, colocated_engines(cfg))
            self.train_group = TrainGroup(spec, cfg.ray, gpu_share=train_gpus)
            self._start_served_models(engine_gpus)
            self.rollout_group = RolloutGroup(cfg.model.path, replace(cfg.rollout, max_model_len=data.engine_length),
                                              cfg.seed, self.train_group.placement,
                                              cfg.ray.cpus_per_worker * self.train_group.dims.world_size,
                                              gpu_share=engine_gpus, loops=self.agents.loops, tools=cfg.tools,
                                              tool_client=self.tools.client() if self.tools else None,
                                              tool_schemas=self.agents.schemas,
                                              adapter=AdapterSpec.of(cfg.model.lora),
                                              fp32_head=cfg.model.fp32_lm_head,
                                              return_routing=cfg.algorithm.router_replay == "r3")
            self.sync = self._weight_sync()
            self.rollout_group.replacements = self.replacements
            if cfg.train.async_mode != "off":
                self.stream = RolloutStream(self.rollout_group, self.prompts, self.sampler, cfg.train.async_mode,
                                            cfg.train.max_staleness, cfg.rollout.agent_loop, cfg.rollout.n,
                                            self.rollout_group.sampling(), cfg.seed, cfg.train.collective_timeout_s)
                self.schedule = RunSchedule(cfg.output_dir, self.rollout_group, self.stream, cfg.train.replay,
                                            cfg.train.record_schedule)
            groups = StepGroups(self.train_group, self.rollout_group, self.reward_pool, self.teacher, self.prompts)
            self.rl_step = RLStep(cfg, groups, self.features, self.sampler, self.stream, self.sync, self.tokenizer,
                                  self.expander)
            self.rollout_group.restore = lambda engine: self.sync.load_into(engine, self.rl_step.policy_version)
        except BaseException:
            self.shutdown()
            raise

    def _start_served_models(self, gpu_share: float) -> None:
        """The engines of the reward terms' models and of the distillation teacher, colocated with
        the training ranks or on their own resources."""
        cfg = self.cfg
        placement = {"train_placement": self.train_group.placement, "gpu_share": gpu_share,
                     "train_cpus": cfg.ray.cpus_per_worker * self.train_group.dims.world_size}
        self.reward_pool.start_models(cfg.seed, **placement)
        distill = cfg.algorithm.distill
        if distill is not None and distill.source == "engine":
            serving = replace(distill.serving, max_model_len=teacher_length(distill, self.engine_length))
            self.teacher = ServedModelGroup("teacher", distill.teacher, serving, cfg.seed, "algorithm.distill.serving",
                                            **placement)
            self.teacher.replacements = self.replacements

    def _weight_sync(self) -> AdapterSync | WeightSync:
        """The adapters alone, or every weight (a LoRA policy's merged, through the object store:
        merged weights are not the shards the ranks keep; so are a GPU run's offloaded shards,
        which live in pinned host memory that sharing would move)."""
        cfg, engines = self.cfg, self.rollout_group
        if cfg.model.lora.syncs_adapters:
            return AdapterSync(self.train_group, engines)
        offloaded_from_gpu = cfg.parallel.offload and cfg.ray.gpus_per_worker > 0
        mode = "object_store" if cfg.model.lora.rank or offloaded_from_gpu else cfg.rollout.sync_mode
        return WeightSync(self.train_group, engines, cfg.rollout.sync_bucket_mb, mode,
                          [engines.placement.ranks_beside(i) for i in range(len(engines.actors))],
                          synced_weight_dtype(cfg.rollout.dtype, self.train_group.on_gpu, cfg.model.fp32_lm_head))

    # -- one step -------------------------------------------------------------

    def step(self, step: int) -> dict[str, float]:
        metrics = self.rl_step.run(step)
        return {**metrics, "workers_replaced": float(self.replacements.used)}

    # -- validation, checkpoints --------------------------------------------

    def validate(self, step: int) -> dict[str, float]:
        """Accuracy on the eval split (greedy by default), judged by eval.reward, generated by the engines."""
        set_phase(f"rlvr step {step}: validate")
        with span("validate"):
            summary, _ = self.evaluator.run(self.rollout_group)
        return {"val/accuracy": summary["accuracy"], "val/reward_errors": summary["reward_errors"]}

    def end_step(self, step: int) -> None:
        """After a step and its validation: the schedule's line for it."""
        if self.schedule is not None:
            self.schedule.write(step)

    def save(self, step: int) -> None:
        if self.schedule is not None:  # the groups in flight finish first: they are part of the state
            self.stream.settle()
            self.schedule.write(step)
        save_training_state(self.checkpoints, step, self.train_group, self.stream or self.sampler,
                            self._driver_state())

    def resume(self, force: bool = False) -> int:
        """Restore the newest checkpoint (when train.resume or `force`, as after a restart)."""
        resume = self.cfg.train.resume or force
        step = restore_training_state(self.checkpoints, self.train_group, self.stream or self.sampler,
                                      self._driver_state()) if resume else 0
        self.rl_step.policy_version = step
        if step or self.cfg.model.lora.syncs_adapters:  # the engines start from model.path, without adapters
            self.sync.run(version=step)
        if self.schedule is not None:
            self.schedule.start(step)
        return step

    def _driver_state(self) -> dict:
        return {**self.features.state(), **({"schedule": self.schedule} if self.schedule is not None else {})}

    def shutdown(self) -> None:
        """Retire every actor of this attempt, dead ones included."""
        self.reward_pool.shutdown()
        for group in (self.tools, self.teacher):
            if group is not None:
                group.shutdown()
        if self.evaluator is not None:
            self.evaluator.shutdown()
        for group in (self.rollout_group, self.train_group):
            if group is not None:
                group.shutdown()


def run_rlvr(cfg: RLJobConfig) -> dict:
    check_rl_job(cfg)
    started = time.time()
    data = load_rl_data(cfg)
    run = run_stage(cfg, "rlvr", lambda checkpoints: RLSession(RLVRTrainer(cfg, data, checkpoints)))
    summary = {"stage": "rlvr", "steps": cfg.train.steps, "resumed_from_step": run.start_step,
               "restarts": run.restarts, "workers_replaced": run.last.get("workers_replaced", 0.0),
               "final_reward": run.last.get("reward/mean"),
               "val_accuracy_after": run.last.get("val/accuracy"), "hf_model": run.hf_dir,
               "time_s": round(time.time() - started, 1)}
    before = run.initial.get("val/accuracy", logged_metric(cfg.output_dir, 0, "val/accuracy"))
    if before is not None:  # a resumed run's first attempt validated before its first step
        summary["val_accuracy_before"] = before
    finish_run(cfg.output_dir, summary)
    return summary


class RLSession:
    """One attempt of the RL stage (`run_stage`): the trainer's groups, validated before the first
    step of a fresh run, every `train.val_every` steps and after the last."""

    def __init__(self, trainer: RLVRTrainer):
        self.trainer, self.cfg = trainer, trainer.cfg

    def resume(self, force: bool) -> int:
        return self.trainer.resume(force)

    def initial_metrics(self) -> dict[str, float]:
        return self.trainer.validate(0) if self.cfg.eval else {}

    def step(self, step: int) -> dict[str, float]:
        metrics = self.trainer.step(step)
        train = self.cfg.train
        if self.cfg.eval and (step == train.steps or (train.val_every and step % train.val_every == 0)):
            metrics.update(self.trainer.validate(step))
        self.trainer.end_step(step)
        return metrics

    def samples(self) -> list[dict]:
        return self.trainer.rl_step.samples

    def save(self, step: int) -> None:
        self.trainer.save(step)

    def export(self, hf_dir: str) -> None:
        self.trainer.train_group.run_all(TrainWorker.export_hf, hf_dir)

    def shutdown(self) -> None:
        self.trainer.shutdown()
