"""`python -m rlsys.run plan`: the layouts of a cluster that fit a job's config, ranked, with the
one to run and why; `--check` runs one step of it here, scaled down, beside its estimate."""

from __future__ import annotations

import os
from dataclasses import dataclass

from rlsys.config.loader import ConfigError, load_config
from rlsys.config.schema import RLJobConfig, TrainJobConfig
from rlsys.planner.estimate import Precision, Workload
from rlsys.planner.search import GIB, Candidate, Cluster, plan, reason, table
from rlsys.planner.shards import ModelShapes


@dataclass(frozen=True)
class PlanArgs:
    config: str
    overrides: list[str]
    gpus: int
    gpu_memory_gib: float
    gpus_per_node: int = 8
    prompt_tokens: int = 512
    """RL: the longest prompt (the sequence is this plus the response budget)."""
    top: int = 10
    check: bool = False


def load_job(path: str, overrides: list[str]) -> RLJobConfig | TrainJobConfig:
    """An RL job's config, else a pretraining or SFT one."""
    try:
        return load_config(RLJobConfig, path, overrides)
    except ConfigError as rl_error:
        try:
            return load_config(TrainJobConfig, path, overrides)
        except ConfigError:
            raise rl_error from None


def model_config(path: str):
    import transformers

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"model.path: no config.json in {path!r} (the planner reads the model's shape from it)")
    return transformers.AutoConfig.from_pretrained(path)


def workload(cfg: RLJobConfig | TrainJobConfig, prompt_tokens: int) -> Workload:
    if isinstance(cfg, RLJobConfig):
        seq_len = prompt_tokens + cfg.rollout.response_budget
        kl = cfg.algorithm.kl_coef > 0 or cfg.algorithm.use_kl_in_reward
        critic = cfg.algorithm.adv_estimator == "gae"
        colocated = cfg.rollout.placement == "colocated"
        return Workload(sequences=cfg.train.prompts_per_step * cfg.rollout.n, seq_len=seq_len,
                        micro_batch_tokens=cfg.train.micro_batch_tokens or cfg.train.micro_batch_size * seq_len,
                        update_passes=cfg.algorithm.ppo_epochs, forward_passes=1 + kl + critic, reference=kl,
                        critic=critic, engine_gib=cfg.rollout.engine_memory_gib if colocated else 0.0,
                        engine_tp=cfg.rollout.tensor_parallel_size, engine_released=cfg.rollout.free_memory_in_update)
    seq_len = cfg.data.max_seq_len
    return Workload(sequences=cfg.train.global_batch_size, seq_len=seq_len,
                    micro_batch_tokens=cfg.train.micro_batch_tokens or cfg.train.micro_batch_size * seq_len)


def precision(cfg) -> Precision:
    """On GPUs ("auto") rlsys computes in bf16 over fp32 masters."""
    params = 2 if cfg.model.dtype == "bfloat16" else 4
    return Precision(param_bytes=params, compute_bytes=4 if cfg.parallel.mixed_precision == "none" else 2)


def overrides_of(best: Candidate) -> str:
    dims = best.layout.dims
    keys = [f"parallel.{name}={getattr(dims, name)}" for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
            if getattr(dims, name) > 1]
    if dims.tp > 1:
        keys += ["parallel.sequence_parallel=true", "parallel.loss_parallel=true"]
    if best.layout.activation_checkpointing:
        keys.append("parallel.activation_checkpointing=true")
    return " ".join(keys)


def run_plan(args: PlanArgs) -> dict:
    cfg = load_job(args.config, args.overrides)
    config = model_config(cfg.model.path)
    shapes = ModelShapes(config)
    work = workload(cfg, args.prompt_tokens)
    critic = ModelShapes(config, value_head=True) if work.critic else None
    cluster = Cluster(args.gpus, args.gpu_memory_gib, args.gpus_per_node)
    ranked, considered = plan(shapes, cluster, work, precision(cfg), critic, cfg.parallel.pp_microbatches)
    print(f"model {config.model_type}, {shapes.total / 1e9:.2f} B parameters; {work.sequences} sequences of <= "
          f"{work.seq_len} tokens a step; {cluster.gpus} GPUs of {cluster.gpu_memory_gib:g} GiB, "
          f"{cluster.gpus_per_node} a node; {considered} layouts considered\n")
    fits = ranked and ranked[0].margin(cluster) >= 0
    print(table(ranked, cluster, args.top))
    if not fits:
        print(f"\nno layout fits {cluster.gpu_memory_gib:g} GiB: the closest need {ranked[0].peak / GIB:.1f} GiB "
              f"(more GPUs, a shorter micro-batch (train.micro_batch_tokens) or a smaller engine share)")
        return {"fits": False}
    best = ranked[0]
    print(f"\nrecommended: {best.layout.name}: {reason(best, cluster)}\n  overrides: {overrides_of(best)}")
    if args.check:
        from rlsys.planner.check import check, check_table

        print("\n--check: one step of the layout on this machine, scaled down\n")
        print(check_table(check(config, best.layout)))
        print("(a tiny model's step peak is mostly the process's fixed overheads; docs/parallel.md compares "
              "peaks on the 0.5B shape)")
    return {"fits": True, "layout": best.layout.name}
