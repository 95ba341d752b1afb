"""The training group: N TrainWorker actors in one placement group, forming
one torch.distributed job. The driver calls a method on every rank at once."""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlsys.actors import kept_actors
from rlsys.actors.cluster import actor_name, check_resources, place_ranks, spawn
from rlsys.actors.group import ActorGroup, Method
from rlsys.actors.train_worker import RENDEZVOUS_TIMEOUT_S, Role, TrainWorker, TrainWorkerSpec
from rlsys.config.layout import RayConfig
from rlsys.data.batching import Batch, split_rows
from rlsys.models.hub import size_text, weights_bytes
from rlsys.trainer.rank_model import LossFn

log = logging.getLogger(__name__)


class TrainGroup(ActorGroup[TrainWorker]):
    def __init__(self, spec: TrainWorkerSpec, ray_cfg: RayConfig, gpu_share: float | None = None):
        """`gpu_share`: GPUs each rank's actor takes of its bundle (default all of
        ray.gpus_per_worker; less when a colocated rollout engine takes the rest)."""
        world_size = spec.dims.world_size
        super().__init__([actor_name("train", rank) for rank in range(world_size)], spec.collective_timeout_s)
        check_resources(world_size, ray_cfg.cpus_per_worker, ray_cfg.gpus_per_worker, "ray.cpus_per_worker")
        bundle = {"CPU": ray_cfg.cpus_per_worker, **({"GPU": ray_cfg.gpus_per_worker} if spec.use_gpu else {})}
        num_gpus = (ray_cfg.gpus_per_worker if gpu_share is None else gpu_share) if spec.use_gpu else 0
        self.shape = (world_size, tuple(sorted(bundle.items())), num_gpus)
        """What a set of kept ranks must match to serve this group (`kept_actors`)."""
        self.dims = spec.dims
        self.on_gpu = spec.use_gpu
        started = time.perf_counter()
        try:
            if self.take_kept("train", self.shape):
                log.info("training group: the %d ranks the last group kept (no process starts)", world_size)
                self.reuse_kept(lambda rank: (rank, spec))
            else:
                log.info("training group: starting %s, each loading its shard of %s (%s)", _ranks(world_size),
                         spec.model.path, size_text(weights_bytes(spec.model.path)))
                kept_actors.make_room({name: amount * world_size for name, amount in bundle.items()})
                self.placement = place_ranks(world_size, bundle)
                actor_cls = ray.remote(TrainWorker)
                self.actors = [
                    spawn(actor_cls, "train", rank, rank, spec, num_cpus=ray_cfg.cpus_per_worker, num_gpus=num_gpus,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(
                              self.placement.group, placement_group_bundle_index=self.placement.bundles[rank]))
                    for rank in range(world_size)
                ]
            master_addr, master_port = self.wait([self.submit(0, TrainWorker.master_address)], [0])[0]
            # Building the ranks' models is start-up: one rank may finish its last collective of it
            # seconds before another on a busy machine, so its wait has the rendezvous's limit.
            placement = self.wait(self.submit_all(TrainWorker.setup, master_addr, master_port),
                                  straggler_timeout_s=max(spec.collective_timeout_s, RENDEZVOUS_TIMEOUT_S))
            log.info("training group: %s ready in %.1f s", _ranks(world_size), time.perf_counter() - started)
            self.dp_ranks = [dp_rank for dp_rank, _ in placement]
            self.collected = sorted((dp_rank, rank) for rank, (dp_rank, collected) in enumerate(placement)
                                    if collected)
        except BaseException:
            self.shutdown()
            raise

    def run_all_ranks(self, method: Method, args_by_rank: dict[int, Any]) -> list:
        """Call `method` on every rank with its own argument; results by rank."""
        return self.wait([self.submit(rank, method, args_by_rank[rank]) for rank in range(len(self.actors))])

    def run_data_parallel(self, method: Method, batch: Batch, **kwargs: Any) -> list:
        """Split `batch` by rows into one shard per data-parallel rank; every rank of a
        data-parallel group (its tensor-parallel peers) gets the same shard. Returns the
        outputs of the collected ranks, one per shard, in data-parallel order."""
        shards = [ray.put(shard) for shard in split_rows(batch, self.dims.dp_size)]
        outputs = self.wait([self.submit(rank, method, shards[self.dp_ranks[rank]], **kwargs)
                             for rank in range(len(self.actors))])
        return [outputs[rank] for _, rank in self.collected]

    def forward(self, batch: Batch, loss_fn: LossFn, role: Role = "policy", record_routing: bool = False
                ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """`TrainWorker.forward` over the batch, split across the data-parallel ranks: the loss function's
        rows, every shard's together in row order, and the pass's metrics (summed over the ranks)."""
        shards = self.run_data_parallel(TrainWorker.forward, batch, loss_fn=loss_fn, role=role,
                                        record_routing=record_routing)
        return {name: torch.cat([rows[name] for rows, _ in shards]) for name in shards[0][0]}, shards[0][1]

    def memory_peaks(self) -> dict[str, float]:
        """VeRL's `perf/max_memory_allocated` and `perf/max_memory_reserved` on a GPU, the peak resident set
        (`perf/max_memory_resident`) on CPU, in GiB: the fullest rank's since the last call (a step's peak
        when called once a step)."""
        peaks = self.run_all(TrainWorker.memory_peaks)
        return {f"perf/max_memory_{kind}_gib": max(rank[kind] for rank in peaks) for kind in peaks[0]}


def _ranks(count: int) -> str:
    return f"{count} rank{'s' if count > 1 else ''}"
