"""Trainer -> rollout weight sync: full tensors under HF names, bucket by bucket.

Each pipeline stage sends its own layers (one stage without pipelining). For
each bucket every rank of the stage packs its own FSDP / tensor-parallel shards
(`weight_shards.pack`, no collective among the ranks), each engine takes all
ranks' buffers from Ray's object store and writes them into its parameters
(`rollout.weight_placement`): through vLLM's weight loaders, which re-shard and
fuse them for the engine's own layout, the first time, then by replaying the
copies those loaders made. Buckets are filled with whole decoder blocks, so a
block's q/k/v and gate/up (fused into one tensor by vLLM) arrive together. No
process holds more than two buckets of the model at a time (one being packed,
one being loaded); the driver holds none.
"""

from __future__ import annotations

import re
import time

from rlsys.actors.failures import wait_all
from rlsys.tracking.phases import call

_BLOCK = re.compile(r"^(.*\.layers\.\d+)\.")


def plan_buckets(nbytes: dict[str, int], bucket_bytes: int) -> list[list[str]]:
    """Pack parameter names, whole blocks at a time and in order, into buckets of
    about `bucket_bytes` (a block larger than that gets a bucket of its own)."""
    groups: dict[str, list[str]] = {}
    for name in nbytes:
        match = _BLOCK.match(name)
        groups.setdefault(match.group(1) if match else name, []).append(name)
    buckets: list[list[str]] = []
    size = 0
    for names in groups.values():
        group_size = sum(nbytes[n] for n in names)
        if buckets and size + group_size <= bucket_bytes:
            buckets[-1].extend(names)
            size += group_size
        else:
            buckets.append(list(names))
            size = group_size
    return buckets


class WeightSync:
    def __init__(self, train_group, rollout_group, bucket_mb: float):
        self.train_group, self.rollout_group = train_group, rollout_group
        nbytes = train_group.run_all("parameter_nbytes")
        self.buckets = [(ranks, names) for ranks in train_group.dims.stage_ranks()
                        for names in plan_buckets(nbytes[ranks[0]], int(bucket_mb * 2**20))]
        self.total_bytes = sum(sum(nbytes[ranks[0]].values()) for ranks in train_group.dims.stage_ranks())

    def run(self) -> dict[str, float]:
        """Each bucket goes as every stage rank's shards, straight from the ranks' object
        stores to the engines (the driver only passes references); the ranks pack the
        next bucket while the engines load this one."""
        started = time.perf_counter()
        train, rollout = self.train_group, self.rollout_group
        loading: list = []
        for index, (ranks, names) in enumerate(self.buckets):
            shards = [call(train.workers[rank].sync_shards, names) for rank in ranks]
            wait_all(loading, rollout.names)
            loading = [call(engine.load_weights, *shards, first=index == 0, last=index == len(self.buckets) - 1)
                       for engine in rollout.engines]
        wait_all(loading, rollout.names)
        return {"sync/time_s": time.perf_counter() - started, "sync/buckets": len(self.buckets),
                "sync/mb": self.total_bytes / 2**20}
