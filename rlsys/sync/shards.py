"""Weight-sync buckets as each rank's own shards, reassembled by the receiver.

Each training rank packs its shard of every parameter in a bucket (`pack`): the
bytes as numpy arrays, which Ray's object store hands to a reader on the same
node without a copy, plus where each shard lies in the full tensor. The rollout
engine groups the shards of all ranks by tensor (`shard_pieces`) and, where it
needs full tensors, places them into a staging buffer (`Assembler`). No
collective runs among the training ranks (gloo's all-gather is far slower than the
object store's copies). An engine on the training ranks' machine reads their shards
in place instead (`share`, `shared_pieces`): in shared
memory on CPU, through CUDA IPC on a GPU; the same pieces, with no copy before the
engine's own.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor


@dataclass(frozen=True)
class ShardEntry:
    name: str
    dtype: torch.dtype
    full_shape: tuple[int, ...]
    shape: tuple[int, ...]
    offset: tuple[int, ...]
    """Where this shard starts in the full tensor, per dimension."""

    @property
    def region(self) -> tuple[slice, ...]:
        """This shard's place in the full tensor, as an index."""
        return tuple(slice(o, o + n) for o, n in zip(self.offset, self.shape))


@dataclass(frozen=True)
class ShardBucket:
    entries: list[ShardEntry]
    data: list[np.ndarray]
    """Each shard's bytes (uint8), in entry order."""


def pack(shards: list[tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]]) -> ShardBucket:
    """(name, local shard, full shape, offset) -> one bucket. The bytes are numpy views of
    the shards themselves (copies in host memory of shards on a GPU): putting the bucket in
    the object store is their only copy."""
    entries = [_entry(*shard) for shard in shards]
    data = [local.contiguous().view(-1).view(torch.uint8).cpu().numpy() for _, local, _, _ in shards]
    return ShardBucket(entries, data)


@dataclass(frozen=True)
class SharedShard:
    """A training rank's shard in shared memory, which an engine on the same machine reads in
    place: where it lies, and the file descriptor of its storage in the rank's process."""

    entry: ShardEntry
    pid: int
    fd: int
    storage_bytes: int
    storage_offset: int
    stride: tuple[int, ...]

    def open(self, storages: dict) -> torch.Tensor:
        """The shard, on its storage mapped through /proc/<pid>/fd (once per storage: `storages`)."""
        key = (self.pid, self.fd)
        if key not in storages:
            fd = os.open(f"/proc/{self.pid}/fd/{self.fd}", os.O_RDWR)
            try:
                storages[key] = torch.UntypedStorage._new_shared_fd_cpu(fd, self.storage_bytes)
            finally:
                os.close(fd)  # the mapping keeps its own duplicate
        return torch.empty(0, dtype=self.entry.dtype).set_(storages[key], self.storage_offset, self.entry.shape,
                                                           self.stride)


@dataclass(frozen=True)
class CudaSharedShard:
    """A training rank's shard on a GPU, which an engine on the same machine reads in place
    through CUDA IPC: the tensor as `torch.multiprocessing` sends one (its allocation's IPC
    handle, its view and the producer's reference count), and the GPU's UUID, since the
    engine's processes number their visible GPUs their own way."""

    entry: ShardEntry
    device_uuid: str
    rebuild_args: tuple

    def open(self, storages: dict) -> torch.Tensor:
        """The shard on this process's index of its GPU (torch maps each allocation once)."""
        device = _device_index(self.device_uuid)
        args = self.rebuild_args
        return rebuild_cuda_tensor(*args[:6], device, *args[7:])


Shared = SharedShard | CudaSharedShard


def share(shards: list[tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]]) -> list[Shared]:
    """Handles to each shard for an engine on this machine to read in place. A shard on a GPU is
    shared where it is (CUDA IPC). A shard in host memory is moved into shared memory, in place:
    every tensor on its storage (FSDP2's padded shard, the parameter the optimizer steps) reads
    and writes the shared pages from then on, so the handles stay valid as long as nothing gives
    the parameter a new storage. That memory is an unlinked file that this process holds open
    (torch's file-descriptor sharing): it goes when the last process mapping it ends, however it
    ends, and never outlives the run in /dev/shm."""
    return [_share(name, local.detach(), full_shape, offset) for name, local, full_shape, offset in shards]


def _share(name: str, local: torch.Tensor, full_shape: tuple[int, ...], offset: tuple[int, ...]) -> Shared:
    entry = _entry(name, local, full_shape, offset)
    if local.is_cuda:
        _, args = reduce_tensor(local)
        return CudaSharedShard(entry, str(torch.cuda.get_device_properties(local.device).uuid), args)
    fd, storage_bytes = local.untyped_storage()._share_fd_cpu_()
    return SharedShard(entry, os.getpid(), fd, storage_bytes, local.storage_offset(), local.stride())


def _device_index(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise RuntimeError(f"GPU {uuid} holds training shards but is not visible to this rollout process")


def _entry(name: str, local: torch.Tensor, full_shape: tuple[int, ...], offset: tuple[int, ...]) -> ShardEntry:
    return ShardEntry(name, local.dtype, tuple(full_shape), tuple(local.shape), tuple(offset))


Pieces = dict[str, list[tuple[ShardEntry, torch.Tensor]]]
"""Each tensor's shards from every rank, by name: (entry, shard viewing the bucket's bytes)."""


def shard_pieces(buckets: list[ShardBucket | None]) -> Pieces:
    """All ranks' buckets (None: a rank with nothing to send) grouped by tensor name, in the
    order the first rank listed them."""
    pieces: Pieces = {}
    for bucket in buckets:
        if bucket is None:
            continue
        for entry, data in zip(bucket.entries, bucket.data):
            pieces.setdefault(entry.name, []).append((entry, _tensor(data, entry)))
    return pieces


def shared_pieces(shards_by_rank: list[list[Shared]]) -> Pieces:
    """Tensors on the training ranks' shared shards, grouped by name as `shard_pieces` groups
    a sync's buckets: reading them reads the trainer's current weights (the ranks must be alive)."""
    storages: dict = {}
    pieces: Pieces = {}
    for shards in shards_by_rank:
        for shard in shards:
            pieces.setdefault(shard.entry.name, []).append((shard.entry, shard.open(storages)))
    return pieces


class Assembler:
    """Places all ranks' shards of tensors into full tensors. The full tensors are views of
    one staging buffer kept across buckets and syncs: fresh memory for every bucket costs
    more in page faults than the copies themselves."""

    def __init__(self):
        self.staging = torch.empty(0, dtype=torch.uint8)

    def release(self) -> None:
        """Free the staging buffer (a colocated engine gives its memory to the trainer)."""
        self.staging = torch.empty(0, dtype=torch.uint8)

    def __call__(self, pieces: Pieces) -> dict[str, torch.Tensor]:
        """Full tensors by name, in the order of `pieces`. A tensor held whole by one rank is
        a view of its object-store buffer. Valid until the next call."""
        split = {name: parts for name, parts in pieces.items() if not _whole(parts)}
        sizes = {name: aligned(_nbytes(parts[0][0])) for name, parts in split.items()}
        if sum(sizes.values()) > self.staging.numel():
            self.staging = torch.empty(sum(sizes.values()), dtype=torch.uint8)
        full, start = {}, 0
        for name, parts in pieces.items():
            if name not in split:
                full[name] = parts[0][1]
                continue
            first = parts[0][0]
            full[name] = self.staging[start:start + _nbytes(first)].view(first.dtype).view(first.full_shape)
            start += sizes[name]
            for entry, shard in parts:
                full[name][entry.region].copy_(shard)
        return full


def _whole(parts: list[tuple[ShardEntry, torch.Tensor]]) -> bool:
    return len(parts) == 1 and parts[0][0].shape == parts[0][0].full_shape


def _nbytes(entry: ShardEntry) -> int:
    """Bytes of the full tensor."""
    return int(np.prod(entry.full_shape, dtype=np.int64)) * entry.dtype.itemsize


def aligned(nbytes: int, alignment: int = 64) -> int:
    """`nbytes` rounded up to a multiple of `alignment`."""
    return -(-nbytes // alignment) * alignment


def _tensor(data: np.ndarray, entry: ShardEntry) -> torch.Tensor:
    if not data.size:
        return torch.empty(entry.shape, dtype=entry.dtype)
    with warnings.catch_warnings():  # the object store's buffers are read-only; nothing writes to them
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8).view(entry.dtype).view(entry.shape)
