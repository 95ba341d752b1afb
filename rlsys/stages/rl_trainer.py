"""The RLVR loop, run by the driver (the single controller).

One step, in data-flow order:
  prompts -> RolloutGroup.rollout (an agent loop per episode) -> rewards (functions in the reward actors,
     reward models and judges in their engines; DAPO: again, until the batch has enough groups of mixed
     rewards; the engines then free their memory) -> each episode's segments as rows of the batch
  -> the teacher's log-probs (distillation; while the trainer works) -> the trainer's passes (rl_logprobs:
     old log-probs unless the update is on-policy or takes the engine's; reference if KL is on) -> KL and the teacher's
     reverse KL in the reward (optional) -> the critic's values (PPO)
  -> advantages (+ the teacher's sampled-token signal; or its top-k tokens join the batch, for the loss)
  -> per mini-batch: critic_step with the value loss (PPO), then train_step with the policy loss
     (mini-batches x epochs) -> weight sync to the engines
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from rlsys.actors.cluster import gpu_shares
from rlsys.actors.failures import WorkerReplacements
from rlsys.actors.phases import PhaseTimer, set_phase
from rlsys.actors.reward_pool import RewardPool
from rlsys.actors.rollout_group import RolloutGroup
from rlsys.actors.served_models import ServedModelGroup
from rlsys.actors.train_group import TrainGroup
from rlsys.actors.train_worker import build_worker_spec
from rlsys.agents.trajectory import Trajectory, episode_rows
from rlsys.algorithms.actor_loss import actor_loss
from rlsys.algorithms.advantages import (
    AdvantageInputs,
    episode_advantages,
    episode_ends,
    gae_advantages_and_returns,
)
from rlsys.algorithms.dapo import mixed_groups, overlong_penalty
from rlsys.algorithms.distill import reverse_kl, top_k_fields
from rlsys.algorithms.kl import KLController, kl_in_reward
from rlsys.algorithms.value_loss import value_loss
from rlsys.config.schema import RLJobConfig
from rlsys.data.batching import (
    Batch,
    EpochSampler,
    collate_rollouts,
    on_last_response_token,
    on_response_tokens,
    split_rows,
)
from rlsys.data.image_tokens import ImagePixels
from rlsys.parallel.router_replay import ROUTING_FIELD, engine_routing
from rlsys.rewards.model_terms import exchanges
from rlsys.rewards.scoring import ScoredSample, reward_inputs
from rlsys.rollout.adapters import AdapterSpec
from rlsys.rollout.vllm_engine import synced_weight_dtype
from rlsys.stages.checkpoints import CheckpointDir, restore_training_state, save_training_state
from rlsys.stages.preflight import check_rl_job
from rlsys.stages.rl_logprobs import SUM_PI_SQUARED, LogprobPasses, is_weights
from rlsys.stages.rl_metrics import agent_metrics, async_metrics, dropped_metrics, mismatch, sample_metrics
from rlsys.stages.rl_samples import sample_records, samples_due
from rlsys.stages.rl_setup import (
    RLData,
    colocated_engines,
    engine_routing_shape,
    load_rl_data,
    teacher_in_trainer,
    teacher_length,
)
from rlsys.stages.rl_update import (
    batch_is_weight_mean,
    loss_counts,
    mini_batches_per_step,
    needs_reference,
    updates_per_step,
)
from rlsys.stages.rollout_stream import RolloutStream
from rlsys.stages.run_dir import finish_run, logged_metric
from rlsys.stages.run_schedule import RunSchedule
from rlsys.stages.stage_loop import run_stage
from rlsys.sync.adapter_sync import AdapterSync
from rlsys.sync.weight_sync import WeightSync
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
        self.updates_per_step = updates_per_step(cfg)
        self.kl_ctrl = KLController(cfg.algorithm.kl_ctrl)
        self.with_critic = cfg.algorithm.adv_estimator == "gae"
        self.greedy_baselines: dict[int, float] | None = {} if cfg.algorithm.adv_estimator == "remax" else None
        """ReMax: the score of the greedy response to each prompt of the step, by prompt index."""
        self.engine_routing = engine_routing_shape(cfg)
        """R3: the layers of the engines' routing that the trainer's MoE blocks replay, and top-k."""
        self.checkpoints = checkpoints or CheckpointDir(cfg.output_dir, cfg.train.keep_last)
        self.train_group = self.rollout_group = self.tools = self.stream = self.schedule = self.teacher = None
        self.replacements = WorkerReplacements(cfg.train.max_worker_restarts)
        """Dead rollout engines, reward workers and served-model engines replaced so far, and the bound."""
        self.policy_version = 0
        """The step whose update the training group's weights hold (what a replaced engine is given)."""
        self.samples: list[dict] = []
        """The last step's responses as rows for the trackers, when it was due to write them."""
        self.reward_pool = RewardPool(cfg.reward, replacements=self.replacements)
        try:
            self.tools = self.agents.start_tools()
            spec = build_worker_spec(cfg, cfg.train.micro_batch_size, cfg.train.steps * self.updates_per_step,
                                     with_reference=needs_reference(cfg.algorithm),
                                     critic=cfg.critic if self.with_critic else None,
                                     teacher=teacher_in_trainer(cfg))
            train_gpus, engine_gpus = gpu_shares(cfg.ray.gpus_per_worker, colocated_engines(cfg))
            self.train_group = TrainGroup(spec, cfg.ray, gpu_share=train_gpus)
            self.logprob_passes = LogprobPasses(self.train_group, cfg)
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
            self.rollout_group.restore = lambda engine: self.sync.load_into(engine, self.policy_version)
            if cfg.train.async_mode != "off":
                self.stream = RolloutStream(self.rollout_group, self.prompts, self.sampler, cfg.train.async_mode,
                                            cfg.train.max_staleness, cfg.rollout.agent_loop, cfg.rollout.n,
                                            self.rollout_group.sampling(), cfg.seed, cfg.train.collective_timeout_s)
                self.schedule = RunSchedule(cfg.output_dir, self.rollout_group, self.stream, cfg.train.replay,
                                            cfg.train.record_schedule)
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
        cfg, timer = self.cfg, PhaseTimer("rlvr", step)
        started = time.perf_counter()
        episodes, groups, scored, rewards, reward_metrics = self._rollout(step, timer)
        samples, episode_of = episode_rows(episodes, cfg.rollout.train_segments)
        episode_of = torch.tensor(episode_of)
        prompt_ids, prompt_pixels = self._prompts_with_pictures(samples)
        batch = collate_rollouts(prompt_ids, [s.response_ids for s in samples], self.tokenizer.pad_token_id,
                                 [s.response_mask for s in samples], prompt_pixels)
        engine_logprobs = torch.tensor([lp for s in samples for lp in s.logprobs])
        if cfg.algorithm.router_replay == "r3":
            batch[ROUTING_FIELD] = engine_routing([s.routing for s in samples], batch["input_ids"].shape[1],
                                                  *self.engine_routing)
        teacher_calls = self._submit_teacher(samples)
        logprob_metrics = self.logprob_passes.add(batch, engine_logprobs, timer)
        token_rewards = on_last_response_token(torch.zeros(len(samples)).masked_scatter(episode_ends(episode_of),
                                                                                        rewards), batch)
        if cfg.algorithm.use_kl_in_reward:
            token_rewards, kl_metrics = kl_in_reward(token_rewards, batch["old_logprobs"], batch["ref_logprobs"],
                                                     batch["loss_mask"], cfg.algorithm.kl_penalty, self.kl_ctrl)
            reward_metrics.update(kl_metrics)
        distill = cfg.algorithm.distill
        distill_kl, distill_metrics = self._distillation(samples, teacher_calls, batch, engine_logprobs, timer)
        reward_metrics.update(distill_metrics)
        if distill is not None and distill.mode == "penalty":
            token_rewards = token_rewards - distill.coef * distill_kl
        if self.with_critic:
            with timer("values"):
                batch["values"] = torch.cat(self.train_group.run_data_parallel("compute_values", batch))
        greedy = self._greedy_scores(episodes)[episode_of] if self.greedy_baselines is not None else None
        inputs = AdvantageInputs(token_rewards, batch["loss_mask"], groups[episode_of], batch.get("values"),
                                 batch.get("old_logprobs"), batch.pop(SUM_PI_SQUARED, None), is_weights(cfg, batch),
                                 greedy)
        batch["advantages"] = episode_advantages(inputs, episode_of, cfg.algorithm)
        if distill is not None and distill.mode == "advantage" and not distill.top_k:
            batch["advantages"] = batch["advantages"] - distill.coef * distill_kl
        if self.with_critic:
            _, batch["returns"] = gae_advantages_and_returns(inputs, cfg.algorithm.gamma, cfg.algorithm.lam)
        self.samples = sample_records(episodes, groups, scored, rewards, batch["advantages"], batch["loss_mask"],
                                      episode_of, self.tokenizer, cfg.tracking.samples_per_log) \
            if samples_due(cfg, step) else []
        with timer("update"):
            update_metrics, sampler_logprobs = self._update(batch, train_actor=step > cfg.critic.warmup_steps)
        update_metrics.update(self.train_group.gpu_memory_peaks())  # the log-prob passes' and the update's
        self.policy_version = step
        with timer("sync"):
            if self.stream is not None and not cfg.train.partial_rollout:
                self.stream.drain()
            sync_metrics = self.sync.run(version=step)
        timer.times["time/step_s"] = time.perf_counter() - started
        return {
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
            **self._accuracy(scored),
            **reward_metrics,
            **sample_metrics(samples, batch, timer.times),
            **(agent_metrics(episodes, samples) if cfg.rollout.agent_loop != "single_turn" else {}),
            **(async_metrics(samples, step, self.stream, cfg.train.max_staleness)
               if self.stream is not None else {}),
            **mismatch(sampler_logprobs, engine_logprobs, batch),
            **logprob_metrics,
            **update_metrics,
            **sync_metrics,
            **timer.times,
            "workers_replaced": float(self.replacements.used),
        }

    def _prompts_with_pictures(self, samples: list[Trajectory]) -> tuple[list[list[int]], list[ImagePixels | None]]:
        """Each sample's prompt ids as the trainer's model reads them: a vision-language prompt's
        image pads expanded, with its pictures' pixels."""
        if self.expander is None:
            return [s.prompt_ids for s in samples], [None] * len(samples)
        return self.expander.expand_prompts([(s.prompt_ids, self.prompts[s.prompt_index].images) for s in samples])

    def _rollout(self, step: int, timer: PhaseTimer
                 ) -> tuple[list[Trajectory], torch.Tensor, list[ScoredSample], torch.Tensor, dict[str, float]]:
        """generate -> reward, with DAPO's dynamic sampling around both: the trajectories (by prompt
        draw, in order), each one's group (its prompt draw: VeRL's uid), their scores, rewards
        (shaped) and reward metrics. Samples an agent loop dropped are left out. The engines then
        free their memory for the trainer."""
        cfg, algo, n = self.cfg, self.cfg.algorithm, self.cfg.rollout.n
        wanted = cfg.train.prompts_per_step
        mixed, uniform, errors = [], [], 0.0
        for draw in range(algo.max_sampling_rounds if algo.filter_groups else 1):
            with timer("generate"):
                samples = self._generate(step, draw, timer)
            with timer("reward"):
                scored, draw_metrics = self.reward_pool.score(reward_inputs(samples, self.prompts),
                                                              exchanges(samples, self.prompts))
            errors += draw_metrics["reward/errors"]
            rewards = self._shaped_rewards(samples, scored)
            scores = torch.tensor([s.score for s in scored])  # mixed by score, not by length penalty
            keep = mixed_groups(scores, n).tolist() if algo.filter_groups else [True] * (len(samples) // n)
            for g, kept in enumerate(keep):
                group = (samples[g * n:(g + 1) * n], scored[g * n:(g + 1) * n], rewards[g * n:(g + 1) * n])
                (mixed if kept else uniform).append(group)
            if len(mixed) >= wanted:
                break
        freed = self.rollout_group.release_memory()
        if len(mixed) < wanted:
            log.warning("step %d: %d of %d prompt groups have mixed rewards after %d draws; filling with "
                        "equal-reward groups", step, len(mixed), wanted, draw + 1)
        groups = (mixed + uniform)[:wanted]
        samples = [s for group in groups for s in group[0]]
        scored = [s for group in groups for s in group[1]]
        rewards = torch.cat([group[2] for group in groups])
        kept = [i for i, sample in enumerate(samples) if not sample.dropped]
        dropped = dropped_metrics(samples, step) if cfg.rollout.agent_loop != "single_turn" else {}
        samples, scored, rewards = [samples[i] for i in kept], [scored[i] for i in kept], rewards[kept]
        metrics = {**self.reward_pool.metrics(scored), "reward/errors": errors, **dropped}
        if freed is not None:
            metrics["rollout/freed_gib"] = freed / 2**30
        if algo.filter_groups:
            metrics.update({"dapo/draws": draw + 1, "dapo/mixed_groups": min(len(mixed), wanted) / wanted})
        if cfg.reward.overlong_buffer_len:
            metrics["reward/overlong_penalty"] = (rewards - torch.tensor([s.score for s in scored])).mean().item()
        return samples, torch.tensor(kept) // n, scored, rewards, metrics

    def _generate(self, step: int, draw: int, timer: PhaseTimer) -> list[Trajectory]:
        """One prompt batch's trajectories, n per prompt in order: generated now, or (asynchronous
        modes) taken from what the engines generated ahead, for the policy of version step - 1."""
        cfg = self.cfg
        if self.stream is not None:
            return [t for group in self.stream.take(cfg.train.prompts_per_step, version=step - 1) for t in group]
        indices, seed = self.sampler.next_indices(), cfg.seed * 100_003 + step + draw * 1_000_000_007
        prompts = [(i, self.prompts[i].ids, self.prompts[i].row) for i in indices]
        samples, engine_times = self.rollout_group.rollout(prompts, cfg.rollout.agent_loop, cfg.rollout.n,
                                                           self.rollout_group.sampling(), seed,
                                                           version=step - 1)  # the policy the last step synced
        timer.times["time/engine_s"] = timer.times.get("time/engine_s", 0.0) + engine_times["engine_s"]
        if self.greedy_baselines is not None:
            self._score_greedy(prompts, seed, step)
        return samples

    def _score_greedy(self, prompts: list[tuple], seed: int, step: int) -> None:
        """ReMax's baselines: the score of a greedy response to each of `prompts`."""
        greedy, _ = self.rollout_group.rollout(prompts, self.cfg.rollout.agent_loop, 1,
                                               self.rollout_group.sampling(temperature=0.0), seed, version=step - 1)
        scored, _ = self.reward_pool.score(reward_inputs(greedy, self.prompts), exchanges(greedy, self.prompts))
        self.greedy_baselines.update({g.prompt_index: s.score for g, s in zip(greedy, scored)})

    def _greedy_scores(self, episodes: list[Trajectory]) -> torch.Tensor:
        return torch.tensor([self.greedy_baselines[e.prompt_index] for e in episodes])

    def _accuracy(self, scored: list[ScoredSample]) -> dict[str, float]:
        """The share of responses the first reward term scores 1 or more (none without terms)."""
        if not self.reward_pool.terms:
            return {}
        verifier = self.reward_pool.terms[0].label
        return {"reward/accuracy": sum(s.terms[verifier] >= 1.0 for s in scored) / len(scored)}

    def _submit_teacher(self, samples: list[Trajectory]) -> list | None:
        """Ask the teacher's engines for their log-prob of every response token, and with top-k their
        most likely tokens (None without the engines)."""
        if self.teacher is None:
            return None
        return self.teacher.submit_split("token_logprobs", [(s.prompt_ids + s.response_ids, len(s.prompt_ids))
                                                            for s in samples], self.cfg.algorithm.distill.top_k)

    def _distillation(self, samples: list[Trajectory], calls: list | None, batch: Batch,
                      engine_logprobs: torch.Tensor, timer: PhaseTimer) -> tuple[torch.Tensor | None, dict]:
        """The reverse KL to the teacher of each sampled token, [B, T] (None when not distilling), and
        its metrics: taken against the engine's sampling log-probs, the policy that drew the tokens.
        With top-k, the batch gains the teacher's top tokens for the loss (`rlsys.algorithms.distill`)."""
        if self.cfg.algorithm.distill is None:
            return None, {}
        with timer("teacher"):
            teacher_logprobs = self._teacher_logprobs(samples, calls, batch)
        return reverse_kl(on_response_tokens(engine_logprobs, batch), teacher_logprobs, batch["loss_mask"])

    def _teacher_logprobs(self, samples: list[Trajectory], calls: list | None, batch: Batch) -> torch.Tensor:
        """The teacher's log-probs of the sampled tokens, [B, T] as the batch's response tokens: from
        its engines' `calls`, or (none) a forward pass of its copy in the training group. With top-k,
        its top tokens and their log-probs go into `batch`."""
        top_k = self.cfg.algorithm.distill.top_k
        if calls is None:
            outputs = self.train_group.run_data_parallel("compute_teacher_logprobs", batch, top_k=top_k)
            rows = {name: torch.cat([out[name] for out in outputs]) for name in outputs[0]}
            batch.update({name: value for name, value in rows.items() if name != "logprobs"})
            return rows["logprobs"]
        per_sample = self.teacher.gather(calls)
        if top_k:
            batch.update(top_k_fields(per_sample, tuple(batch["input_ids"].shape),
                                      [len(s.prompt_ids) for s in samples], top_k))
        sampled = [lp for s, tokens in zip(samples, per_sample)
                   for lp, kept in zip(tokens.sampled, s.response_mask) if kept]
        return on_response_tokens(torch.tensor(sampled), batch)

    def _shaped_rewards(self, samples: list[Trajectory], scored: list[ScoredSample]) -> torch.Tensor:
        rewards = torch.tensor([s.score for s in scored])
        if self.cfg.reward.overlong_buffer_len:
            lengths = torch.tensor([len(s.response_ids) for s in samples])
            rewards = rewards + overlong_penalty(lengths, self.cfg.rollout.response_budget,
                                                 self.cfg.reward.overlong_buffer_len,
                                                 self.cfg.reward.overlong_penalty_factor)
        return rewards

    def _update(self, batch: Batch, train_actor: bool) -> tuple[dict[str, float], torch.Tensor | None]:
        """ppo_epochs passes over the batch in mini-batches of whole prompt groups, each updating
        the critic (PPO) and then, unless the critic is warming up, the policy. Returns the mean
        metrics and the trainer's log-probs of the policy that sampled the rows: the old
        log-probs of a trainer pass, else the first mini-batch's, taken by its update before
        any optimizer step (None when neither exists)."""
        algo = self.cfg.algorithm
        num_minis = mini_batches_per_step(self.cfg)
        sampler_logprobs = batch["old_logprobs"] if self.logprob_passes.source == "trainer" else None
        weight_mean = batch_is_weight_mean(self.cfg, batch)
        sums = {"rollout_corr/batch_norm_factor": weight_mean} if weight_mean is not None else {}
        for _ in range(algo.ppo_epochs):
            for mini in split_rows(batch, num_minis):
                counts, metrics = loss_counts(self.cfg, mini, weight_mean), {}
                if self.with_critic:
                    loss_fn = value_loss(counts, self.cfg.critic.cliprange_value, algo.loss_agg)
                    metrics.update(self.train_group.run_data_parallel("critic_step", mini, loss_fn=loss_fn)[0])
                if train_actor:
                    wants_rows = sampler_logprobs is None  # only the first mini-batch's, and only once
                    loss_fn = actor_loss(counts, algo, self.cfg.rollout.temperature, with_logprobs=wants_rows)
                    outputs = self.train_group.run_data_parallel("train_step", mini, loss_fn=loss_fn)
                    if wants_rows:
                        sampler_logprobs = torch.cat([rows["logprobs"] for _, rows in outputs])
                    metrics.update({f"actor/{k}" if k in ("grad_norm", "lr") else k: v
                                    for k, v in outputs[0][0].items()})
                for name, value in metrics.items():
                    sums[name] = sums.get(name, 0.0) + value / self.updates_per_step
        return sums, sampler_logprobs

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
        self.policy_version = step
        if step or self.cfg.model.lora.syncs_adapters:  # the engines start from model.path, without adapters
            self.sync.run(version=step)
        if self.schedule is not None:
            self.schedule.start(step)
        return step

    def _driver_state(self) -> dict:
        return {"kl_ctrl": self.kl_ctrl, **({"schedule": self.schedule} if self.schedule is not None else {})}

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
        return self.trainer.samples

    def save(self, step: int) -> None:
        self.trainer.save(step)

    def export(self, hf_dir: str) -> None:
        self.trainer.train_group.run_all("export_hf", hf_dir)

    def shutdown(self) -> None:
        self.trainer.shutdown()
