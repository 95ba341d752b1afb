"""The rollout group: vLLM engines in Ray actors sharing each prompt batch."""

from __future__ import annotations

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlsys.actors.cluster import actor_name, check_resources, spawn, wait_placed
from rlsys.actors.group import ActorGroup
from rlsys.actors.rollout_worker import RolloutWorker, Sample
from rlsys.config.schema import RolloutConfig

ENGINE_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}
"""Transparent huge pages for torch's CPU allocations of 2 MiB and more in the engines: a
colocated engine's weights are freed in every update and grown back for the sync, and 2 MiB
pages fault in faster than 4 KiB ones. No effect on GPU memory."""


class RolloutGroup(ActorGroup):
    def __init__(self, model_path: str, cfg: RolloutConfig, seed: int, train_placement, train_cpus: float,
                 gpu_share: float = 0.0):
        """colocated: engine i sits in bundle i of the training group's placement group and takes
        no extra CPUs (generation and training alternate); separate: a placement group of its own."""
        super().__init__([actor_name("rollout", i) for i in range(cfg.num_engines)])
        self.cfg = cfg
        self.own_placement = None
        if cfg.placement == "colocated":
            placement, num_cpus, num_gpus = train_placement, 0, gpu_share
            bundles = len(train_placement.bundle_specs)
            threads = max(1, int(train_cpus) // cfg.num_engines)
        else:
            gpus = cfg.gpus_per_engine * cfg.tensor_parallel_size
            check_resources(cfg.num_engines, cfg.cpus_per_engine, gpus, "rollout.cpus_per_engine")
            bundle = {"CPU": cfg.cpus_per_engine, **({"GPU": gpus} if gpus else {})}
            placement = self.own_placement = placement_group([bundle] * cfg.num_engines, strategy="PACK")
            wait_placed(placement, f"rollout engines ({cfg.num_engines} x {bundle})")
            num_cpus, num_gpus, bundles = cfg.cpus_per_engine, gpus, cfg.num_engines
            threads = max(1, int(cfg.cpus_per_engine))
        self.releases_memory = cfg.placement == "colocated" and cfg.free_memory_in_update
        actor_cls = ray.remote(RolloutWorker)
        try:
            self.actors = [
                spawn(actor_cls, "rollout", i, model_path, cfg, seed + i, threads, self.releases_memory,
                      env=ENGINE_ENV, num_cpus=num_cpus, num_gpus=num_gpus,
                      scheduling_strategy=PlacementGroupSchedulingStrategy(
                          placement, placement_group_bundle_index=i % bundles))
                for i in range(cfg.num_engines)
            ]
            self.wait([engine.__ray_ready__.remote() for engine in self.actors])
        except BaseException:
            self.shutdown()
            raise

    def generate(self, prompts: list[tuple[int, list[int]]], seed: int, n: int, temperature: float,
                 max_new_tokens: int) -> list[Sample]:
        """Split the prompts across engines (contiguous shares) and return samples in prompt order."""
        engines = len(self.actors)
        shares = [prompts[i * len(prompts) // engines:(i + 1) * len(prompts) // engines] for i in range(engines)]
        busy = [i for i in range(engines) if shares[i]]
        refs = [self.submit(i, "generate", shares[i], n, temperature, self.cfg.top_p, max_new_tokens, seed)
                for i in busy]
        prompt_ids = dict(prompts)
        return [sample for generated in self.wait(refs, busy) for sample in generated.samples(prompt_ids)]

    def release_memory(self) -> None:
        """The trainer's turn: colocated engines free their weights (and KV cache, on GPU)."""
        if self.releases_memory:
            self.run_all("release_memory")

    def shutdown(self) -> None:
        super().shutdown()
        if self.own_placement is not None:
            remove_placement_group(self.own_placement)
