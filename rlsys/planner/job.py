"""`python -m rlsys.run plan`: the layouts of a cluster that fit a job's config, ranked, with the
one to run and why; `--check` runs one step of it here, scaled down, beside its estimate."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, fields

from rlsys.config.layout import ParallelConfig
from rlsys.config.loader import ConfigError, load_config
from rlsys.config.rollout import RolloutConfig
from rlsys.config.schema import RLJobConfig, TrainJobConfig
from rlsys.data.batching import check_train_batch
from rlsys.models.directory import read_model_config
from rlsys.models.lora import check_lora
from rlsys.parallel.parallelize import check_layout
from rlsys.planner.estimate import Layout, Precision, Workload
from rlsys.planner.search import GIB, Cluster, plan, reason, table
from rlsys.planner.shards import ModelShapes
from rlsys.rl.algorithm_checks import check_algorithm
from rlsys.rl.passes import old_logprobs_source
from rlsys.rl.update import check_update_batches


@dataclass(frozen=True)
class PlanArgs:
    config: str
    overrides: list[str]
    gpus: int
    gpu_memory_gib: float
    gpus_per_node: int = 8
    prompt_tokens: int = 512
    """RL: the longest prompt (the sequence is this plus the response budget)."""
    headroom: float = 0.1
    host_memory_gib: float = 1024.0
    """Host memory of a node, for the states `parallel.offload` keeps there."""
    top: int = 10
    check: bool = False
    check_full: bool = False


def load_job(path: str, overrides: list[str], gpus: int | None = None) -> RLJobConfig | TrainJobConfig:
    """An RL job's config, else a pretraining or SFT one; `gpus`: the planned cluster's, which size the keys
    left to the cluster (else this machine's)."""
    try:
        return load_config(RLJobConfig, path, overrides, gpus)
    except ConfigError as rl_error:
        try:
            return load_config(TrainJobConfig, path, overrides, gpus)
        except ConfigError:
            raise rl_error from None


def workload(cfg: RLJobConfig | TrainJobConfig, prompt_tokens: int, engine_kv_gib: float = 0.0) -> Workload:
    """`engine_kv_gib`: a colocated rollout engine's KV cache on a GPU (`engine_kv`)."""
    train = cfg.train
    if isinstance(cfg, TrainJobConfig):
        return Workload(sequences=train.global_batch_size, seq_len=cfg.data.max_seq_len,
                        micro_batch_rows=train.micro_batch_size, micro_batch_tokens=train.micro_batch_tokens,
                        lora_rank=cfg.model.lora.rank)
    algo, rollout = cfg.algorithm, cfg.rollout
    kl = algo.kl_coef > 0 or algo.use_kl_in_reward
    critic = algo.adv_estimator == "gae"
    old_logprobs = old_logprobs_source(cfg) == "trainer"  # a forward pass of its own
    colocated = rollout.placement == "colocated"
    return Workload(sequences=train.prompts_per_step * rollout.n, seq_len=prompt_tokens + rollout.response_budget,
                    micro_batch_rows=train.micro_batch_size, micro_batch_tokens=train.micro_batch_tokens,
                    update_passes=algo.ppo_epochs * (2 if critic else 1),  # a critic trains beside the policy
                    forward_passes=old_logprobs + kl + critic, reference=kl, critic=critic,
                    lora_rank=cfg.model.lora.rank,
                    engine_gib=engine_kv_gib if colocated else 0.0,
                    engine_tp=rollout.tensor_parallel_size, engine_released=rollout.free_memory_in_update)


def engine_kv(rollout: RolloutConfig, shapes: ModelShapes, precision: Precision, gpu_memory_gib: float) -> float:
    """A rollout engine's KV cache on a GPU, in GiB: rollout.engine_memory_gib, else what its share of the
    device (rollout.gpu_memory_utilization) leaves after its weights, as vLLM sizes it."""
    if rollout.engine_memory_gib is not None:
        return rollout.engine_memory_gib
    weights = shapes.total * precision.engine_bytes / rollout.tensor_parallel_size / 2**30
    return max(0.0, rollout.gpu_memory_utilization * gpu_memory_gib - weights)


def validator(cfg: RLJobConfig | TrainJobConfig, config) -> Callable[[ParallelConfig], None]:
    """The job's own preflight checks of a candidate `parallel:` section (ConfigError if refused)."""

    def validate(parallel: ParallelConfig) -> None:
        dims = check_layout(parallel, config)
        check_lora(cfg.model, parallel, config)
        if isinstance(cfg, RLJobConfig):
            check_algorithm(cfg.algorithm, parallel)
            check_update_batches(cfg, dims.dp_size)
        else:
            check_train_batch(cfg.train, dims.dp_size)

    return validate


def precision(cfg) -> Precision:
    """On GPUs ("auto") rlsys computes in bf16 over fp32 masters."""
    params = 2 if cfg.model.dtype == "bfloat16" else 4
    mixed = cfg.parallel.mixed_precision != "none"
    return Precision(param_bytes=params, compute_bytes=2 if mixed else params, mixed=mixed)


def overrides_of(layout: Layout, base: ParallelConfig) -> str:
    """The `parallel.` keys that turn the job's section into `layout`'s."""
    chosen = layout.parallel
    keys = [f"parallel.{f.name}={str(getattr(chosen, f.name)).lower()}" for f in fields(chosen)
            if getattr(chosen, f.name) != getattr(base, f.name)]
    return " ".join(keys) or "(none: the config's own layout)"


def resources_of(cfg: RLJobConfig | TrainJobConfig, layout: Layout) -> str:
    """The `ray.*` and `rollout.*` keys that give `layout` its GPUs: a GPU per training rank and, for
    colocated engines, one engine per `rollout.tensor_parallel_size` of the ranks' GPUs."""
    keys = ["ray.gpus_per_worker=1"]
    rollout = getattr(cfg, "rollout", None)
    if rollout is not None and rollout.placement == "colocated":
        keys.append(f"rollout.num_engines={max(1, layout.dims.world_size // rollout.tensor_parallel_size)}")
    return " ".join(keys)


def _nodes(cluster: Cluster) -> str:
    nodes, gpus = -(-cluster.gpus // cluster.gpus_per_node), cluster.ranks_per_node
    return f"{nodes} node{'s' if nodes > 1 else ''} of {gpus} GPU{'s' if gpus > 1 else ''}"


def run_plan(args: PlanArgs) -> dict:
    if args.prompt_tokens < 1:
        raise ConfigError(f"--prompt-tokens: must be > 0, got {args.prompt_tokens}")
    cfg = load_job(args.config, args.overrides, args.gpus)
    config = read_model_config(cfg.model.path, "model.path")  # the shape is enough: no weights needed
    shapes = ModelShapes(config)
    kv = engine_kv(cfg.rollout, shapes, precision(cfg), args.gpu_memory_gib) if isinstance(cfg, RLJobConfig) else 0
    work = workload(cfg, args.prompt_tokens, kv)
    critic = ModelShapes(config, value_head=True) if work.critic else None
    if not 0 <= args.headroom < 1:
        raise ConfigError(f"--headroom: a share of the GPU's memory in [0, 1), got {args.headroom:g}")
    cluster = Cluster(args.gpus, args.gpu_memory_gib, args.gpus_per_node, args.headroom,
                      host_memory_gib=args.host_memory_gib)
    ranked, considered = plan(shapes, cluster, work, precision(cfg), cfg.parallel, validator(cfg, config), critic)
    print(f"model {config.model_type}, {shapes.total / 1e9:.2f} B parameters; {work.sequences} sequences of <= "
          f"{work.seq_len} tokens a step; {cluster.gpus} GPUs of {cluster.gpu_memory_gib:g} GiB, "
          f"{cluster.gpus_per_node} a node, {cluster.headroom:.0%} of each kept free; {cluster.host_memory_gib:g} GiB "
          f"of host memory a node; "
          f"{considered} layouts considered\n")
    if not ranked:
        raise ConfigError(f"--gpus: no layout of {cluster.gpus} GPUs that the model and the job take (tp, pp and cp "
                          f"must divide the model's heads and layers, the data-parallel size the batch)")
    print(table(ranked, cluster, args.top))
    best = ranked[0]
    if not best.fits(cluster):
        print(f"\nno layout fits {cluster.usable_bytes / GIB:.1f} GiB a GPU and {cluster.usable_host_bytes / GIB:.0f} "
              f"GiB of host memory a node: the closest need {best.peak / GIB:.1f} GiB a GPU and "
              f"{best.host_bytes(cluster) / GIB:.0f} GiB a node (more GPUs, more host memory, a shorter micro-batch "
              f"(train.micro_batch_tokens) or a smaller engine share)")
        return {"fits": False}
    print(f"\nrecommended: {best.layout.name}: {reason(best, cluster)}\n"
          f"  overrides: {overrides_of(best.layout, cfg.parallel)}\n"
          f"  resources: {resources_of(cfg, best.layout)} (a Ray cluster of {_nodes(cluster)})")
    if args.check:
        from rlsys.planner.check import check, check_table

        print("\n--check: one step of the layout on this machine, scaled down\n")
        print(check_table(check(config, best.layout)))
        print("(a tiny model's step peak is mostly the process's fixed overheads; docs/parallel.md compares "
              "peaks on the 0.5B shape)")
    if args.check_full:
        _check_full_size(cfg.model.path, best.layout)
    return {"fits": True, "layout": best.layout.name, "parallel": best.layout.parallel,
            "resources": resources_of(cfg, best.layout)}


def _available_memory() -> int:
    """Bytes of memory this machine can give a new process (Linux's MemAvailable, else what is free)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _check_full_size(model_dir: str, layout: Layout) -> None:
    """Rank 0 of `layout` at full size here, if this machine's memory holds it."""
    from rlsys.planner.check import FULL_SIZE_STEP, check_full_size, full_size_estimate, full_size_table

    print("\n--check-full: rank 0 of the layout at full size, its peers stood in by a fake process group, "
          "random weights, fp32 on this machine's CPU\n")
    if layout.dims.pp > 1 or layout.dims.ep > 1:
        print("not run: pp and ep exchange sizes through collectives, which a fake process group cannot carry")
        return
    needed, available = full_size_estimate(model_dir, layout, FULL_SIZE_STEP), _available_memory()
    if needed > 0.9 * available:
        print(f"not run: the rank needs about {needed / GIB:.1f} GiB; this machine has {available / GIB:.1f} GiB free")
        return
    print(full_size_table([check_full_size(model_dir, layout)]))
