"""Where a group of vLLM engines runs: in the training ranks' bundles (colocated, reserving no
CPUs: generation and training take turns) or in a placement group of its own (separate). The
rollout engines and the engines of frozen models place themselves the same way.

On GPUs a colocated engine's tensor-parallel ranks each sit on one training rank's GPU, one engine
of a kind per GPU: engine i takes the GPUs of ranks i*tp .. i*tp+tp-1. With tp > 1 the engine's
actor holds no GPU and vLLM's Ray executor puts its workers in those ranks' bundles
(`VLLM_RAY_BUNDLE_INDICES`, each taking the engine's share of a GPU). A separate engine's bundle
holds all its GPUs, which vLLM's worker processes use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlsys.actors import kept_actors
from rlsys.actors.cluster import RankPlacement, check_resources, cluster_gpus, wait_placed
from rlsys.config.loader import ConfigError
from rlsys.config.schema import RLJobConfig


class EngineLayout(Protocol):
    """The fields `RolloutConfig` and `ServingConfig` share."""

    placement: str
    num_engines: int
    tensor_parallel_size: int
    cpus_per_engine: float
    gpus_per_engine: float


@dataclass(frozen=True)
class EngineSeat:
    """How engine actor i is created: its resources, bundle, and the environment vLLM places its
    tensor-parallel workers by."""

    num_cpus: float
    num_gpus: float
    strategy: PlacementGroupSchedulingStrategy
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class EnginePlacement:
    group: PlacementGroup
    bundles: tuple[int, ...]
    """The bundles engines take, in engine order (for colocated engines, the ranks' bundles in rank order)."""
    num_cpus: float
    """CPUs each engine actor reserves."""
    num_gpus: float
    """GPUs each engine actor reserves (a share of a training rank's, when colocated)."""
    threads: int
    """torch threads of each engine."""
    owned: bool
    """The group is the engines' own, removed with them."""
    tensor_parallel_size: int = 1
    workers_in_bundles: bool = False
    """Colocated on GPUs with tp > 1: the engine's tensor-parallel workers are Ray actors in the ranks'
    bundles (vLLM's Ray executor), each with `num_gpus`; the engine's own actor holds no GPU."""

    def seat(self, index: int) -> EngineSeat:
        if not self.workers_in_bundles:
            bundle = self.bundles[index % len(self.bundles)]
            return EngineSeat(self.num_cpus, self.num_gpus, PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=bundle))
        tp = self.tensor_parallel_size
        bundles = self.bundles[index * tp:(index + 1) * tp]
        # vLLM's executor finds the placement group as the engine actor's, captured for its workers
        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=bundles[0],
                                                    placement_group_capture_child_tasks=True)
        return EngineSeat(0, 0, strategy, {"VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, bundles)),
                                           "VLLM_RAY_PER_WORKER_GPUS": f"{self.num_gpus:g}"})

    def ranks_beside(self, index: int) -> tuple[int, ...]:
        """The training ranks in whose bundles engine `index`'s processes run, on their devices (colocated
        engines; `bundles` lists the ranks' bundles in rank order); none for engines of their own."""
        if self.owned:
            return ()
        if self.workers_in_bundles:
            tp = self.tensor_parallel_size
            return tuple(range(index * tp, (index + 1) * tp))
        return (index % len(self.bundles),)

    def release(self) -> None:
        if self.owned:
            remove_placement_group(self.group)


def check_colocated_engines(cfg: EngineLayout, ranks: int, gpus_per_worker: float, key: str) -> None:
    """On GPUs, colocated engines of a kind take one training rank's GPU per engine rank: refuse more
    than the ranks hold, before anything waits for a GPU share that never frees. On CPU the engines
    share the ranks' cores, as many as asked."""
    if cfg.placement != "colocated" or not gpus_per_worker:
        return
    tp = cfg.tensor_parallel_size
    gpus = cfg.num_engines * tp
    if gpus > ranks:
        raise ConfigError(
            f"{key}.num_engines: {cfg.num_engines} colocated engines x {tp} GPU{'s' if tp > 1 else ''} each "
            f"(tensor_parallel_size) = {gpus} GPUs, but the {ranks} training ranks hold {ranks} (one each, "
            f"ray.gpus_per_worker={gpus_per_worker:g}); a colocated engine's ranks take one GPU each: set "
            f"{key}.num_engines to at most {ranks // tp} or {key}.placement: separate")


def engine_keep_key(cfg: EngineLayout, train_placement: RankPlacement | None, gpu_share: float) -> tuple | None:
    """Where a group of engines sits, which a set of kept engines must share to serve it
    (`kept_actors`): in the training group's placement group (colocated), or in bundles of their own.
    None for tensor-parallel engines: their worker processes are the engine's own, not kept."""
    if cfg.tensor_parallel_size > 1:
        return None
    if cfg.placement == "colocated":
        return "colocated", train_placement.group.id.hex(), cfg.num_engines, gpu_share
    return "separate", cfg.num_engines, cfg.cpus_per_engine, cfg.gpus_per_engine


def place_engines(cfg: EngineLayout, train_placement: RankPlacement | None, train_cpus: float, gpu_share: float,
                  what: str, key: str) -> EnginePlacement:
    """colocated: engine i sits in the bundle of rank i (on GPUs with tp > 1, its workers in the
    bundles of ranks i*tp ..), its threads the training group's CPUs shared among the engines;
    separate: `cfg.num_engines` bundles of their own (`key` names the setting to change when they
    do not fit)."""
    tp = cfg.tensor_parallel_size
    if cfg.placement == "colocated":
        placement = EnginePlacement(train_placement.group, train_placement.bundles, 0, gpu_share,
                                    max(1, int(train_cpus) // cfg.num_engines), owned=False, tensor_parallel_size=tp,
                                    workers_in_bundles=gpu_share > 0 and tp > 1)
        if placement.workers_in_bundles:
            _check_one_node_each(train_placement, cfg.num_engines, tp, key.rsplit(".", 1)[0])
        return placement
    gpus = cfg.gpus_per_engine * tp
    check_resources(cfg.num_engines, cfg.cpus_per_engine, gpus, key)
    kept_actors.retire()  # actors kept idle for another group hold bundles these may need
    bundle = {"CPU": cfg.cpus_per_engine, **({"GPU": gpus} if gpus else {})}
    group = placement_group([bundle] * cfg.num_engines, strategy="PACK")
    wait_placed(group, f"{what} ({cfg.num_engines} x {bundle})")
    return EnginePlacement(group, tuple(range(cfg.num_engines)), cfg.cpus_per_engine, gpus,
                           max(1, int(cfg.cpus_per_engine)), owned=True)


def _check_one_node_each(ranks: RankPlacement, num_engines: int, tp: int, key: str) -> None:
    """A tensor-parallel engine runs on one node: the ranks whose GPUs it takes must share one."""
    for engine in range(num_engines):
        if len(set(ranks.nodes[engine * tp:(engine + 1) * tp])) > 1:
            raise ConfigError(f"{key}.tensor_parallel_size: engine {engine}'s {tp} GPUs, those of training ranks "
                              f"{engine * tp}..{(engine + 1) * tp - 1}, span nodes; give each node a multiple "
                              f"of {tp} training ranks")


def check_engine_resources(cfg: RLJobConfig, world_size: int) -> None:
    """Every group of engines fits: colocated ones on the training ranks' GPUs, separate ones in the
    cluster; a tensor-parallel engine's ranks each on a GPU of their own."""
    for key, engines in cfg.engine_groups():
        tp = engines.tensor_parallel_size
        if engines.placement == "colocated":
            check_colocated_engines(engines, world_size, cfg.ray.gpus_per_worker, key)
            continue
        if tp > 1 and engines.gpus_per_engine not in (0, 1):
            raise ConfigError(f"{key}.gpus_per_engine: {engines.gpus_per_engine:g}; each of a tensor-parallel "
                              f"engine's {tp} ranks takes a GPU of its own (1)")
        check_resources(engines.num_engines, engines.cpus_per_engine, engines.gpus_per_engine * tp,
                        f"{key}.cpus_per_engine", cfg.ray)
    _check_separate_gpus(cfg, world_size)


def _check_separate_gpus(cfg: RLJobConfig, world_size: int) -> None:
    """Engines of their own take GPUs beside the training ranks': all of them must fit the cluster's."""
    separate = [(key, engines) for key, engines in cfg.engine_groups()
                if engines.placement == "separate" and engines.gpus_per_engine]
    if not separate:
        return
    training = world_size * cfg.ray.gpus_per_worker
    engines = sum(group.num_engines * group.tensor_parallel_size * group.gpus_per_engine for _, group in separate)
    total = cluster_gpus(cfg.ray)
    if training + engines > total:
        key = separate[0][0]
        raise ConfigError(f"{key}.gpus_per_engine: the training ranks take {training:g} GPUs and the separate "
                          f"engines {engines:g} of their own, {training + engines:g} in all, but the Ray cluster has "
                          f"{total:g}; lower {key}.num_engines or the parallel degrees, set {key}.placement: "
                          f"colocated, or {key}.gpus_per_engine: 0 to generate on CPU")
