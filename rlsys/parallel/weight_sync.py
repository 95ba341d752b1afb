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

Training on CPU with the engines on the same machine, the engines instead read
the ranks' shards in place: the first sync moves each rank's shards into shared
memory (`weight_shards.share`, where the optimizer then keeps stepping them) and
hands the engines their file descriptors; every sync is then one call to each engine,
which copies from the mapped shards straight into its parameters. Nothing is
packed or copied on the trainer's side and nothing goes through the object
store. (On GPU the same would take CUDA IPC handles, not built: untested.)
"""

from __future__ import annotations

import os
import re
import shutil
import time

import ray

from rlsys.actors.failures import wait_all
from rlsys.parallel.weight_shards import SharedShard
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
    def __init__(self, train_group, rollout_group, bucket_mb: float, shared_memory: bool = True):
        self.train_group, self.rollout_group = train_group, rollout_group
        nbytes = train_group.run_all("parameter_nbytes")
        self.buckets = [(ranks, names) for ranks in train_group.dims.stage_ranks()
                        for names in plan_buckets(nbytes[ranks[0]], int(bucket_mb * 2**20))]
        self.total_bytes = sum(sum(nbytes[ranks[0]].values()) for ranks in train_group.dims.stage_ranks())
        self.stage_names = {rank: list(nbytes[ranks[0]]) for ranks in train_group.dims.stage_ranks()
                            for rank in ranks}
        self.in_place = shared_memory and _one_machine_with_room(train_group, rollout_group, self.total_bytes)
        self.shared: list[list[SharedShard]] | None = None
        """Every rank's handles to its shards in shared memory, from the first sync on (`in_place`)."""

    def run(self) -> dict[str, float]:
        started = time.perf_counter()
        if self.in_place:
            self._load_in_place()
        else:
            self._load_buckets()
        return {"sync/time_s": time.perf_counter() - started, "sync/in_place": float(self.in_place),
                "sync/buckets": 1 if self.in_place else len(self.buckets), "sync/mb": self.total_bytes / 2**20}

    def _load_buckets(self) -> None:
        """Each bucket goes as every stage rank's shards, straight from the ranks' object
        stores to the engines (the driver only passes references); the ranks pack the
        next bucket while the engines load this one."""
        train, rollout = self.train_group, self.rollout_group
        loading: list = []
        for index, (ranks, names) in enumerate(self.buckets):
            shards = [call(train.workers[rank].sync_shards, names) for rank in ranks]
            wait_all(loading, rollout.names)
            loading = [call(engine.load_weights, *shards, first=index == 0, last=index == len(self.buckets) - 1)
                       for engine in rollout.engines]
        wait_all(loading, rollout.names)

    def _load_in_place(self) -> None:
        """The engines read the ranks' shards where the optimizer keeps them: the first sync
        moves them into shared memory (one call to each rank); every sync is then one call
        to each engine, with no copy on the trainer's side and none through the object store."""
        train, rollout = self.train_group, self.rollout_group
        if self.shared is None:
            self.shared = train.run_all_ranks("share_shards", self.stage_names)
        wait_all([call(engine.load_shared, *self.shared) for engine in rollout.engines], rollout.names)


def _one_machine_with_room(train_group, rollout_group, nbytes: int) -> bool:
    """Whether the engines can read the training ranks' memory: CPU training, every rank and
    engine on one Ray node, and room for the shards in its /dev/shm (a container's is often
    64 MB)."""
    if train_group.on_gpu:
        return False
    actors = train_group.workers + rollout_group.engines
    facts = wait_all([actor.__ray_call__.remote(_node_and_shm_room) for actor in actors],
                     train_group.names + rollout_group.names)
    return len({node for node, _ in facts}) == 1 and min(room for _, room in facts) > nbytes


def _node_and_shm_room(actor) -> tuple[str, int]:
    room = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    return ray.get_runtime_context().get_node_id(), room
