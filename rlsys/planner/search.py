"""Which layouts of a cluster fit a job, and which to run: every pp x dp_replicate x dp_shard x
cp x tp (x ep) that `ParallelDims` and the model accept, with and without activation
checkpointing, estimated on each pipeline stage's first rank (it holds the largest shards:
torch.chunk gives the first pieces the remainder) and ranked as the design documents decide:
fit the memory and give every data-parallel rank sequences; then the highest throughput: the
shortest estimated step (`estimate.step_time`: compute, the pipeline bubble, and the traffic
compute cannot hide, each link at its own speed, so the slowest links weigh most); then the
least model parallelism (tp, pp, cp) and the least traffic across nodes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from rlsys.parallel.dims import LayoutError, ParallelDims
from rlsys.parallel.tp import TP_FAMILIES
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
    speeds: Speeds = Speeds()


@dataclass
class Candidate:
    layout: Layout
    memory: RankMemory
    """The rank with the highest peak."""
    peak: int
    traffic: Traffic
    time: StepTime

    def margin(self, cluster: Cluster) -> float:
        return cluster.gpu_memory_gib * GIB - self.peak

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


def layouts(shapes: ModelShapes, cluster: Cluster, work: Workload, pp_microbatches: int = 4) -> Iterator[Layout]:
    """Layouts of `cluster.gpus` ranks the model takes, tp within a node, every data-parallel
    rank with at least one sequence."""
    config, experts = shapes.config, shapes.expert_total > 0
    tp_ok = config.model_type in TP_FAMILIES
    for pp, dp_replicate, dp_shard, cp, tp in factorizations(cluster.gpus, 5):
        if tp > cluster.gpus_per_node or (tp > 1 and not tp_ok) or dp_replicate * dp_shard > work.sequences:
            continue
        token_ranks = dp_shard * cp * tp
        for ep in [e for e in range(1, token_ranks + 1) if token_ranks % e == 0] if experts else [1]:
            try:
                dims = ParallelDims(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep)
                dims.check_model(config)
            except LayoutError:
                continue
            for checkpointing in (False, True):
                yield Layout(dims, checkpointing, pp_microbatches=max(pp_microbatches, pp))


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


def plan(shapes: ModelShapes, cluster: Cluster, work: Workload, precision: Precision,
         critic_shapes: ModelShapes | None = None, pp_microbatches: int = 4) -> tuple[list[Candidate], int]:
    """The layouts that fit, best first, and how many were considered."""
    candidates = [evaluate(shapes, layout, work, precision, cluster, critic_shapes)
                  for layout in layouts(shapes, cluster, work, pp_microbatches)]
    fitting = [c for c in candidates if c.margin(cluster) >= 0]
    if not fitting:  # nothing fits: show the closest
        return sorted(candidates, key=lambda c: c.peak)[:5], len(candidates)
    return sorted(fitting, key=Candidate.rank_key), len(candidates)


def reason(best: Candidate, cluster: Cluster) -> str:
    """Why the planner picks `best`, in the decision order it ranks by."""
    dims, time, parts = best.layout.dims, best.time, []
    parts.append(f"fits with {best.margin(cluster) / GIB:.1f} GiB to spare on its fullest rank")
    parts.append(f"the shortest estimated training step of those that fit, {time.total:.1f} s (compute "
                 f"{time.compute:.1f}, pipeline bubble {time.bubble:.1f}, communication not hidden {time.exposed:.1f})")
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
    return "; ".join(parts)


def table(candidates: list[Candidate], cluster: Cluster, limit: int = 10) -> str:
    rows = ["| layout | step s | peak GiB | margin GiB | states GiB | activations GiB | engine GiB | intra-node GB | "
            "inter-node GB |", "|---|---|---|---|---|---|---|---|---|"]
    for c in candidates[:limit]:
        m = c.memory
        rows.append(f"| {c.layout.name} | {c.time.total:.1f} | {c.peak / GIB:.1f} | {c.margin(cluster) / GIB:.1f} "
                    f"| {m.states / GIB:.1f} "
                    f"| {(m.activations + m.gathered) / GIB:.1f} | {m.engine / GIB:.1f} "
                    f"| {c.traffic.intra_bytes / 1e9:.1f} | {c.traffic.inter_bytes / 1e9:.1f} |")
    return "\n".join(rows)
