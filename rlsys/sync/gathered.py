"""Weight-sync buckets gathered on the training ranks and read in place by the engine beside each rank.

For each bucket the ranks of a pipeline stage gather the full tensors among themselves, cast to the
engine's dtype before they travel (`rlsys.sync.bucket_gather`: one all-gather for FSDP's row
shards), and each rank that has a colocated engine on its device writes them into one of its two
staging buffers. The engine maps that rank's buffers once (`share`: shared memory on CPU, CUDA IPC
on a GPU) and reads each bucket from them in place, while the ranks gather the next bucket into the
other buffer. No engine reads another rank's memory, which is a GPU's condition: a colocated engine
sees its own rank's GPU alone (VeRL's and OpenRLHF's colocated sync works the same way)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from rlsys.sync.bucket_gather import travel_dtype
from rlsys.sync.shards import ShardEntry, Shared, aligned, share

SLOTS = 2
"""Staging buffers per rank: a bucket is gathered into one while the engines read the other."""

@dataclass(frozen=True)
class BufferEntry:
    """One full tensor in a staging buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    """Its first byte in the buffer."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """The tensor, viewing `buffer` (uint8)."""
        return buffer[self.start:self.start + self.nbytes].view(self.dtype).view(self.shape)

    def piece(self, buffer: torch.Tensor) -> tuple[ShardEntry, torch.Tensor]:
        """The tensor as the engine's writer takes a whole one (`rlsys.sync.shards.Pieces`)."""
        return ShardEntry(self.name, self.dtype, self.shape, self.shape, (0,) * len(self.shape)), self.view(buffer)


def capacity(buckets: list[list[str]], params: dict[str, torch.Tensor], engine_dtype: torch.dtype | None) -> int:
    """Bytes of a staging buffer: the largest bucket's full tensors, each aligned."""
    return max((sum(aligned(p.numel() * travel_dtype(p, engine_dtype).itemsize)
                    for p in (params[name] for name in names)) for names in buckets), default=0)


class GatherBuffers:
    """A rank's staging buffers for gathered buckets, on its device, in memory an engine beside it maps."""

    def __init__(self, nbytes: int, device: torch.device):
        self.buffers = [torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device) for _ in range(SLOTS)]

    def share(self) -> list[Shared]:
        """Handles to the buffers, one per slot (on CPU the buffers move into shared memory)."""
        return share([(f"gathered-{slot}", buffer, tuple(buffer.shape), (0,))
                      for slot, buffer in enumerate(self.buffers)])

    @torch.no_grad()
    def write(self, slot: int, tensors: Iterable[tuple[str, torch.Tensor]],
              engine_dtype: torch.dtype | None) -> list[BufferEntry]:
        """Write full tensors into buffer `slot`, each cast to the dtype the engine takes; their places."""
        buffer, start, entries = self.buffers[slot], 0, []
        for name, tensor in tensors:
            entry = BufferEntry(name, travel_dtype(tensor, engine_dtype), tuple(tensor.shape), start)
            if start + entry.nbytes > buffer.numel():
                raise ValueError(f"{name}: the bucket outgrows the {buffer.numel()}-byte staging buffer "
                                 f"sized by `capacity` for the sync's buckets")
            entry.view(buffer).copy_(tensor)
            entries.append(entry)
            start += aligned(entry.nbytes)
        if buffer.is_cuda:
            torch.cuda.current_stream(buffer.device).synchronize()  # the engine reads from another process
        return entries


def open_own_buffers(handles_by_rank: list[list[Shared]]) -> list[torch.Tensor]:
    """The staging buffers (one per slot) of the rank on this process's device, mapped: on a GPU the
    rank whose buffers are on the GPU this process uses; on CPU the engine's one rank."""
    own = handles_by_rank[0]
    if torch.cuda.is_available():
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        matching = [handles for handles in handles_by_rank if handles[0].device_uuid == uuid]
        if not matching:
            raise RuntimeError(f"no training rank beside this rollout process shares GPU {uuid}")
        own = matching[0]
    storages: dict = {}
    return [handle.open(storages) for handle in own]

