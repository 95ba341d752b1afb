"""Which layouts of a cluster fit a job, and which to run: every pp x dp_replicate x dp_shard x
cp x tp (x ep) that `ParallelDims` and the model accept, with and without activation
checkpointing, with and without offloading the states to host memory, estimated on each
pipeline stage's first rank (it holds the largest shards: torch.chunk gives the first pieces the
remainder) and ranked as the design documents decide: fit the GPU's memory and the host's and
give every data-parallel rank sequences; then the highest throughput: the shortest estimated
step (`estimate.step_time`: compute, the pipeline bubble, the traffic compute cannot hide, each
link at its own speed, so the slowest links weigh most, and an offloaded optimizer's step on the
host); then the least model parallelism (tp, pp, cp) and the least traffic across nodes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from rlsys.config.layout import ParallelConfig
from rlsys.config.loader import ConfigError
from rlsys.parallel.dims import MESH_DIMS
from rlsys.planner.estimate import (
    Layout,
    Precision,
    RankMemory,
    Speeds,
    StepTime,
    Traffic,
    Workload,
    rank_memory,
    step_time,
    traffic,
)
from rlsys.planner.shards import ModelShapes

GIB = 2**30


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpu_memory_gib: float
    gpus_per_node: int = 8
    headroom: float = 0.1
    """Share of each GPU's memory left for what the estimate does not count: the CUDA context,
    NCCL's buffers, the allocator's fragmentation."""
    speeds: Speeds = Speeds()
    host_memory_gib: float = 1024.0
    """Host memory of a node (offloaded states of all its ranks live there)."""
    host_headroom: float = 0.25
    """Share of the host's memory left to everything else: the processes, the rollout engines' host
    side, the page cache, checkpoints on their way to disk."""

    @property
    def usable_bytes(self) -> float:
        return self.gpu_memory_gib * GIB * (1 - self.headroom)

    @property
    def usable_host_bytes(self) -> float:
        return self.host_memory_gib * GIB * (1 - self.host_headroom)

    @property
    def ranks_per_node(self) -> int:
        return min(self.gpus, self.gpus_per_node)


@dataclass
class Candidate:
    layout: Layout
    memory: RankMemory
    """The rank with the highest peak."""
    peak: int
    traffic: Traffic
    time: StepTime

    def margin(self, cluster: Cluster) -> float:
        """Bytes to spare below the usable memory (the GPU's less the headroom)."""
        return cluster.usable_bytes - self.peak

    def host_bytes(self, cluster: Cluster) -> int:
        """Offloaded states of a node's ranks (each as the fullest rank's)."""
        return self.memory.host * cluster.ranks_per_node

    def fits(self, cluster: Cluster) -> bool:
        return self.margin(cluster) >= 0 and self.host_bytes(cluster) <= cluster.usable_host_bytes

    @property
    def model_parallel(self) -> int:
        """Ranks one copy of the dense weights is split over beyond FSDP: tp x pp x cp."""
        dims = self.layout.dims
        return dims.tp * dims.pp * dims.cp

    def rank_key(self) -> tuple:
        """The estimated step time (in steps of 5%: smaller differences are within the model's
        error), then the least model parallelism, then the least traffic across nodes."""
        return (round(math.log(self.time.total) / math.log(1.05)), self.model_parallel, self.traffic.inter_bytes)


def factorizations(n: int, parts: int) -> Iterator[tuple[int, ...]]:
    if parts == 1:
        yield (n,)
        return
    for first in range(1, n + 1):
        if n % first == 0:
            for rest in factorizations(n // first, parts - 1):
                yield (first, *rest)


def layouts(shapes: ModelShapes, cluster: Cluster, work: Workload, base: ParallelConfig,
            validate: Callable[[ParallelConfig], None]) -> Iterator[Layout]:
    """Layouts of `cluster.gpus` ranks, tp within a node, every data-parallel rank with a
    sequence: `base` (the job's `parallel:` section) with each set of degrees, sequence and loss
    parallel under tp, enough pipeline micro-batches for its schedule, with and without activation
    checkpointing, with and without offload; those `validate` (the job's own preflight) refuses are left out."""
    experts = shapes.expert_total > 0
    for pp, dp_replicate, dp_shard, cp, tp in factorizations(cluster.gpus, len(MESH_DIMS)):
        if tp > cluster.gpus_per_node or dp_replicate * dp_shard > work.sequences:
            continue
        token_ranks = dp_shard * cp * tp
        for ep in [e for e in range(1, token_ranks + 1) if token_ranks % e == 0] if experts else [1]:
            microbatches = base.pp_microbatches if pp == 1 else -(-max(base.pp_microbatches, pp) // pp) * pp
            for checkpointing, offload in ((False, False), (True, False), (False, True), (True, True)):
                parallel = replace(base, pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep,
                                   sequence_parallel=tp > 1, loss_parallel=tp > 1, pp_microbatches=microbatches,
                                   activation_checkpointing=checkpointing, offload=offload)
                try:
                    validate(parallel)
                except ConfigError:
                    continue
                yield Layout(parallel)


def evaluate(shapes: ModelShapes, layout: Layout, work: Workload, precision: Precision, cluster: Cluster,
             critic_shapes: ModelShapes | None = None) -> Candidate:
    worst, worst_peak = None, -1
    for stage in layout.dims.stage_ranks():
        memory = rank_memory(shapes, layout, work, precision, stage.start, critic_shapes)
        peak = memory.peak(work.engine_released)
        if peak > worst_peak:
            worst, worst_peak = memory, peak
    moved = traffic(shapes, layout, work, precision, cluster.gpus_per_node)
    return Candidate(layout, worst, worst_peak, moved, step_time(shapes, layout, work, moved, cluster.speeds))


def plan(shapes: ModelShapes, cluster: Cluster, work: Workload, precision: Precision, base: ParallelConfig,
         validate: Callable[[ParallelConfig], None], critic_shapes: ModelShapes | None = None
         ) -> tuple[list[Candidate], int]:
    """The layouts that fit, best first (else the 5 closest to fitting), and how many were considered."""
    candidates = [evaluate(shapes, layout, work, precision, cluster, critic_shapes)
                  for layout in layouts(shapes, cluster, work, base, validate)]
    fitting = [c for c in candidates if c.fits(cluster)]
    if not fitting:  # nothing fits: show the closest
        return sorted(candidates, key=lambda c: c.peak)[:5], len(candidates)
    return sorted(fitting, key=Candidate.rank_key), len(candidates)


def reason(best: Candidate, cluster: Cluster) -> str:
    """Why the planner picks `best`, in the decision order it ranks by."""
    dims, time, parts = best.layout.dims, best.time, []
    parts.append(f"fits with {best.margin(cluster) / GIB:.1f} GiB to spare on its fullest rank")
    parts.append(f"among the shortest estimated training steps (within 5%) of those that fit, {time.total:.1f} s "
                 f"(compute {time.compute:.1f}, pipeline bubble {time.bubble:.1f}, communication not hidden "
                 f"{time.exposed:.1f})")
    inter = best.traffic.inter_bytes
    parts.append("no collective crosses a node" if inter == 0 else
                 f"{inter / 1e9:.1f} GB per rank per step cross nodes")
    if best.model_parallel > 1:
        within = f", tp={dims.tp} within a node" if dims.tp > 1 else ""
        parts.append(f"tp x pp x cp = {best.model_parallel}{within}")
    else:
        parts.append("the weights split by FSDP alone (no tp, pp or cp)")
    parts.append("recomputes every block (without, it does not fit or is slower)"
                 if best.layout.activation_checkpointing else "no recomputation")
    if best.layout.offload:
        parts.append(f"offloads the states to host memory ({best.host_bytes(cluster) / GIB:.0f} GiB a node of "
                     f"{cluster.host_memory_gib:g}; without, it does not fit or is slower): AdamW on the host adds "
                     f"{time.host_optimizer:.1f} s a step, the copies to and from the GPU "
                     f"{best.traffic.intra.get('offload host-to-device', 0) / 1e9:.0f} and "
                     f"{best.traffic.intra.get('offload device-to-host', 0) / 1e9:.0f} GB, hidden behind compute "
                     f"where FSDP2 prefetches")
    return "; ".join(parts)


def table(candidates: list[Candidate], cluster: Cluster, limit: int = 10) -> str:
    rows = ["| layout | step s | peak GiB | margin GiB | states GiB | activations + gathered GiB | engine GiB "
            "| host GiB a node | intra-node GB | inter-node GB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in candidates[:limit]:
        m = c.memory
        rows.append(f"| {c.layout.name} | {c.time.total:.1f} | {c.peak / GIB:.1f} | {c.margin(cluster) / GIB:.1f} "
                    f"| {m.states / GIB:.1f} "
                    f"| {(m.activations + m.gathered) / GIB:.1f} | {m.engine / GIB:.1f} "
                    f"| {c.host_bytes(cluster) / GIB:.0f} "
                    f"| {c.traffic.intra_bytes / 1e9:.1f} | {c.traffic.inter_bytes / 1e9:.1f} |")
    return "\n".join(rows)
