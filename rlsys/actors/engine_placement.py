"""Where a group of vLLM engines runs: in the training ranks' bundles (colocated, reserving no
CPUs: generation and training take turns) or in a placement group of its own (separate). The
rollout engines and the engines of frozen models place themselves the same way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlsys.actors import kept_actors
from rlsys.actors.cluster import check_resources, wait_placed


class EngineLayout(Protocol):
    """The fields `RolloutConfig` and `ServingConfig` share."""

    placement: str
    num_engines: int
    tensor_parallel_size: int
    cpus_per_engine: float
    gpus_per_engine: float


@dataclass
class EnginePlacement:
    group: PlacementGroup
    bundles: int
    num_cpus: float
    """CPUs each engine actor reserves."""
    num_gpus: float
    """GPUs each engine actor reserves (a share of a training rank's, when colocated)."""
    threads: int
    """torch threads of each engine."""
    owned: bool
    """The group is the engines' own, removed with them."""

    def strategy(self, index: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index % self.bundles)

    def release(self) -> None:
        if self.owned:
            remove_placement_group(self.group)


def engine_keep_key(cfg: EngineLayout, train_placement: PlacementGroup | None, gpu_share: float) -> tuple | None:
    """Where a group of engines sits, which a set of kept engines must share to serve it
    (`kept_actors`): in the training group's placement group (colocated), or in bundles of their own.
    None for tensor-parallel engines: their worker processes are the engine's own, not kept."""
    if cfg.tensor_parallel_size > 1:
        return None
    if cfg.placement == "colocated":
        return "colocated", train_placement.id.hex(), cfg.num_engines, gpu_share
    return "separate", cfg.num_engines, cfg.cpus_per_engine, cfg.gpus_per_engine


def place_engines(cfg: EngineLayout, train_placement: PlacementGroup | None, train_cpus: float, gpu_share: float,
                  what: str, key: str) -> EnginePlacement:
    """colocated: engine i sits in bundle i of the training group's placement group, its threads
    the training group's CPUs shared among the engines; separate: `cfg.num_engines` bundles of their
    own (`key` names the setting to change when they do not fit)."""
    if cfg.placement == "colocated":
        return EnginePlacement(train_placement, len(train_placement.bundle_specs), 0, gpu_share,
                               max(1, int(train_cpus) // cfg.num_engines), owned=False)
    gpus = cfg.gpus_per_engine * cfg.tensor_parallel_size
    check_resources(cfg.num_engines, cfg.cpus_per_engine, gpus, key)
    kept_actors.retire()  # actors kept idle for another group hold bundles these may need
    bundle = {"CPU": cfg.cpus_per_engine, **({"GPU": gpus} if gpus else {})}
    group = placement_group([bundle] * cfg.num_engines, strategy="PACK")
    wait_placed(group, f"{what} ({cfg.num_engines} x {bundle})")
    return EnginePlacement(group, cfg.num_engines, cfg.cpus_per_engine, gpus, max(1, int(cfg.cpus_per_engine)),
                           owned=True)
