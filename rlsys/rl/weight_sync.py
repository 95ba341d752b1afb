"""Trainer -> rollout weight sync, as the driver runs it: full tensors under HF names,
bucket by bucket, or read in place.

The driver calls the two groups (`rlsys.actors`); each group's actors call the rest of
this package: a training rank packs or shares its shards (`shards`), an engine writes
them into its parameters (`placement`).

Each pipeline stage sends its own layers (one stage without pipelining). For
each bucket every rank of the stage packs its own FSDP / tensor-parallel shards
(`shards.pack`, no collective among the ranks), each engine takes all
ranks' buffers from Ray's object store and writes them into its parameters
(`placement`): through vLLM's weight loaders, which re-shard and
fuse them for the engine's own layout, the first time, then by replaying the
copies those loaders made. Buckets are filled with whole decoder blocks, so a
block's q/k/v and gate/up (fused into one tensor by vLLM) arrive together. No
process holds more than two buckets of the model at a time (one being packed,
one being loaded); the driver holds none.

With the engines on the ranks' machine (and, on GPU, seeing the ranks' GPUs),
the engines instead read the ranks' shards in place: the first sync hands the
engines handles to each rank's shards (`shards.share`: on CPU the shards
move into shared memory, where the optimizer then keeps stepping them; on a GPU
they are CUDA IPC handles); every sync is then one call to each engine, which
copies from the mapped shards straight into its parameters. Nothing is packed or
copied on the trainer's side and nothing goes through the object store.

Where an engine sees only its own rank's device (a colocated engine on a GPU), the ranks gather each
bucket of full tensors among themselves instead, and each engine reads the bucket in place from the
rank beside it (`gathered`), the next bucket gathered while the engines read this one.
"""

from __future__ import annotations

import logging
import os
import re
import resource
import shutil
import time
from dataclasses import dataclass

import ray

from rlsys.actors.rollout_worker import RolloutWorker
from rlsys.actors.train_worker import TrainWorker
from rlsys.sync.gathered import SLOTS

log = logging.getLogger(__name__)

_BLOCK = re.compile(r"^(.*\.layers\.\d+)\.")
_SPARE_FDS = 256
"""File descriptors each process keeps free beyond those the shared shards take."""


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
    """Streams the training group's policy to every engine of the rollout group. The groups
    are `rlsys.actors`' TrainGroup and RolloutGroup: this class calls their actors' sync
    methods (`parameter_nbytes`, `sync_shards`, `share_shards`, `share_gather_buffers`, `gather_bucket`,
    `empty_gpu_cache`; `load_weights`, `load_shared`, `load_gathered`) and nothing else of them.

    `mode` is `rollout.sync_mode`; `engine_ranks[e]`, the training ranks on engine e's devices
    (colocated engines; `EnginePlacement.ranks_beside`), which a gathered sync reads from;
    `engine_dtype`, what the engines compute in (None: the trainer's dtype)."""

    def __init__(self, train_group, rollout_group, bucket_mb: float, mode: str = "auto",
                 engine_ranks: list[tuple[int, ...]] | None = None, engine_dtype=None):
        self.train_group, self.rollout_group = train_group, rollout_group
        nbytes = train_group.run_all(TrainWorker.parameter_nbytes)
        stages = train_group.dims.stage_ranks()
        self.buckets = [(ranks, names) for ranks in stages
                        for names in plan_buckets(nbytes[ranks[0]], int(bucket_mb * 2**20))]
        self.total_bytes = sum(sum(nbytes[ranks[0]].values()) for ranks in stages)
        self.stage_names = {rank: list(nbytes[ranks[0]]) for ranks in stages for rank in ranks}
        self.engine_ranks = engine_ranks or []
        self.engine_dtype = engine_dtype
        self.mode = self._choose(mode)
        self.in_place = self.mode == "shared"
        self.shards_shared = False
        """Whether the engines hold handles to the ranks' shards (`in_place`, from the first sync on)."""
        self.handles: list | None = None
        self.gather_handles: dict[int, list] | None = None
        """Each serving rank's handles to its staging buffers (`gathered`, from the first sync on)."""
        self.engines_mapped: set[int] = set()
        """The engines that have mapped their ranks' staging buffers."""

    def _choose(self, mode: str) -> str:
        """The sync this run gets for `rollout.sync_mode`: `shared`, `gathered` or `object_store`."""
        if mode == "object_store":
            return mode
        if mode == "gathered" or (mode == "auto" and self.train_group.on_gpu):
            reason = self._cannot_gather()
            if not reason:
                return "gathered"
            if mode == "gathered":
                log.warning("weight sync through Ray's object store, not gathered: %s", reason)
                return "object_store"
        return "shared" if self._can_share() else "object_store"

    def _cannot_gather(self) -> str:
        """Why the engines cannot read gathered buckets from the ranks beside them, or "" if they can."""
        if self.train_group.dims.pp > 1:
            return "an engine beside one rank holds one pipeline stage's weights alone (parallel.pp > 1)"
        engines = len(self.rollout_group.actors)
        if len(self.engine_ranks) != engines or not all(self.engine_ranks):
            return "the engines are not colocated with the training ranks (rollout.placement)"
        return ""

    def run(self, version: int = 0) -> dict[str, float]:
        """Send the policy; the engines label what they sample next `version` (the trainer's step).
        An engine that dies meanwhile is replaced (`ActorGroup.replace_dead`) and the policy sent to
        every engine again."""
        started = time.perf_counter()
        if self.train_group.on_gpu and self.rollout_group.releases_memory:
            # the engines wake into the GPUs the ranks' allocators still hold at the update's peak
            self.train_group.run_all(TrainWorker.empty_gpu_cache)
        try:
            self._load(version)
        except Exception as err:  # a dead engine is replaced here; anything else goes on up
            engine = self.rollout_group.replace_dead(err)
            self.shards_shared = False  # the new engine maps the ranks' shards; the others keep theirs
            self.engines_mapped.discard(engine)
            self._load(version)
        return {"sync/time_s": time.perf_counter() - started, "sync/in_place": float(self.in_place),
                "sync/gathered": float(self.mode == "gathered"),
                "sync/buckets": 1 if self.in_place else len(self.buckets), "sync/mb": self.total_bytes / 2**20}

    def load_into(self, engine: int, version: int) -> None:
        """Send the policy to engine `engine` alone (one that replaced a dead engine), labelled `version`."""
        if self.in_place:
            handles = self._handles()
            loading = self.rollout_group.submit(engine, RolloutWorker.load_shared, *handles, version=version)
            self.rollout_group.wait([loading], [engine])
        elif self.mode == "gathered":
            self.engines_mapped.discard(engine)
            self._load_gathered(version, [engine])
        else:
            self._load_buckets(version, [engine])

    def _load(self, version: int) -> None:
        engines = list(range(len(self.rollout_group.actors)))
        if self.in_place:
            self._load_in_place(version)
        elif self.mode == "gathered":
            self._load_gathered(version, engines)
        else:
            self._load_buckets(version, engines)

    def _load_buckets(self, version: int, engines: list[int]) -> None:
        """Each bucket goes as every stage rank's shards, straight from the ranks' object
        stores to the `engines` (the driver only passes references); the ranks pack the
        next bucket while the engines load this one."""
        train, rollout = self.train_group, self.rollout_group
        loading: list = []
        for index, (ranks, names) in enumerate(self.buckets):
            shards = [train.submit(rank, TrainWorker.sync_shards, names) for rank in ranks]
            rollout.wait(loading, engines)
            loading = [rollout.submit(engine, RolloutWorker.load_weights, *shards, first=index == 0,
                                      last=index == len(self.buckets) - 1, version=version) for engine in engines]
        rollout.wait(loading, engines)

    def _load_gathered(self, version: int, engines: list[int]) -> None:
        """Each bucket gathered by the ranks into one of two staging buffers, and read by each engine
        from the rank beside it; the ranks gather the next bucket into the other buffer while the
        engines read this one (a buffer is written again only once every engine has read it)."""
        train, rollout = self.train_group, self.rollout_group
        handles = self._gather_handles()
        loading: list = []
        gathering: list = []
        for index, (ranks, names) in enumerate(self.buckets):
            slot = index % SLOTS
            gathered = {rank: train.submit(rank, TrainWorker.gather_bucket, names, slot, self.engine_dtype)
                        for rank in ranks}
            rollout.wait(loading, engines)
            if gathering:
                train.wait(gathering, list(ranks))
            loading = [rollout.submit(engine, RolloutWorker.load_gathered, self._first_handles(engine, handles),
                                      gathered[self.engine_ranks[engine][0]], slot, first=index == 0,
                                      last=index == len(self.buckets) - 1, version=version) for engine in engines]
            gathering = list(gathered.values())
        rollout.wait(loading, engines)
        train.wait(gathering, list(self.buckets[-1][0]))

    def _gather_handles(self) -> dict[int, list]:
        """The staging buffers' handles of every rank an engine reads from, asked for once."""
        if self.gather_handles is None:
            serving = sorted({rank for ranks in self.engine_ranks for rank in ranks})
            names = [names for _, names in self.buckets]
            refs = [self.train_group.submit(rank, TrainWorker.share_gather_buffers, names, self.engine_dtype)
                    for rank in serving]
            self.gather_handles = dict(zip(serving, self.train_group.wait(refs, serving)))
        return self.gather_handles

    def _first_handles(self, engine: int, handles: dict[int, list]) -> list[list] | None:
        """The buffers' handles of the ranks beside `engine` the first time it reads a bucket; else None."""
        if engine in self.engines_mapped:
            return None
        self.engines_mapped.add(engine)
        return [handles[rank] for rank in self.engine_ranks[engine]]

    def _load_in_place(self, version: int) -> None:
        """The engines read the ranks' shards where the optimizer keeps them: the first sync
        asks each rank for handles to them (on CPU moving them into shared memory) and sends
        them to the engines; every sync is then one call to each engine, with no copy on the
        trainer's side and none through the object store."""
        handles = [] if self.shards_shared else self._handles()
        self.rollout_group.run_all(RolloutWorker.load_shared, *handles, version=version)
        self.shards_shared = True

    def _handles(self) -> list:
        """Each rank's handles to its shards, asked for once (they never change)."""
        if self.handles is None:
            self.handles = self.train_group.run_all_ranks(TrainWorker.share_shards, self.stage_names)
        return self.handles

    def _can_share(self) -> bool:
        """Whether the engines can read the training ranks' memory: every rank and engine on one
        Ray node; on GPU, every rank's GPU visible to every engine (CUDA IPC opens an allocation
        only on a GPU the process sees, as a colocated engine sees its rank's); on CPU, room for
        the shards in its /dev/shm (a container's is often 64 MB) and a file descriptor free for
        each shared storage in every rank and engine."""
        ranks, engines = self.train_group.on_each(_room), self.rollout_group.on_each(_room)
        if len({room.node for room in ranks + engines}) > 1:
            return False
        reason = _gpus_unseen(ranks, engines) if self.train_group.on_gpu else self._no_room(ranks, engines)
        if reason:
            log.warning("weight sync through Ray's object store, not in place: %s", reason)
        return not reason

    def _no_room(self, ranks: list[_Host], engines: list[_Host]) -> str:
        """Why the shards cannot be shared in host memory, or "" if they can."""
        shm_free = min(room.shm_free for room in ranks + engines)
        rank_fds = [len(self.stage_names[rank]) for rank in range(len(ranks))]
        fds_needed = rank_fds + [sum(rank_fds)] * len(engines)
        fds_free = [room.fds_free for room in ranks + engines]
        if shm_free <= self.total_bytes:
            return f"/dev/shm has {shm_free / 2**20:.0f} MB free for {self.total_bytes / 2**20:.0f} MB of weights"
        if any(free < needed + _SPARE_FDS for free, needed in zip(fds_free, fds_needed)):
            return (f"an actor has {min(fds_free)} file descriptors free for up to {max(fds_needed)} shared "
                    f"shards (raise `ulimit -n`)")
        return ""


def _gpus_unseen(ranks: list[_Host], engines: list[_Host]) -> str:
    """Why the engines cannot open the ranks' shards on their GPUs, or "" if they can."""
    rank_gpus = set().union(*(room.gpus for room in ranks))
    if all(rank_gpus <= set(room.gpus) for room in engines):
        return ""
    return (f"the training ranks' GPUs {sorted(rank_gpus)} are not all visible to every engine "
            f"({[list(room.gpus) for room in engines]}): an engine reads in place only shards on GPUs it sees, "
            f"and a colocated engine sees its own rank's GPU alone")


@dataclass(frozen=True)
class _Host:
    """Where an actor runs and what it has free for shards shared in place."""

    node: str
    gpus: tuple[str, ...]
    """Ray's ids of the GPUs the actor sees."""
    shm_free: int
    fds_free: int


def _room(actor) -> _Host:
    """This actor's node and GPUs, free bytes in /dev/shm and free file descriptors (none without
    Linux's /dev/shm and /proc, which the engines open host-memory shards through)."""
    context = ray.get_runtime_context()
    node, gpus = context.get_node_id(), tuple(str(gpu) for gpu in ray.get_gpu_ids())
    if not (os.path.isdir("/dev/shm") and os.path.isdir("/proc/self/fd")):
        return _Host(node, gpus, 0, 0)
    fds_free = resource.getrlimit(resource.RLIMIT_NOFILE)[0] - len(os.listdir("/proc/self/fd"))
    return _Host(node, gpus, shutil.disk_usage("/dev/shm").free, fds_free)
