"""The full tensors of a bucket of parameters, gathered in one collective where their layout allows.

The weight sync's gathered mode (`rlsys.sync.gathered`) needs whole tensors on every rank of a
pipeline stage. `DTensor.full_tensor` gathers one tensor at a time, in its own dtype: for a bucket of
a few hundred tensors, a few hundred collectives moving fp32 master weights. Here every tensor that
FSDP shards along its rows over one mesh dimension (replicated over any other: plain FSDP and HSDP)
is cast first, packed with the bucket's others into one byte buffer, and the buffers are all-gathered
once per mesh dimension; each rank's rows are then cut back out. Other layouts (tensor parallel's
column or row splits, several sharded mesh dimensions) go through `full_tensor` one by one, cast
before they travel as well. Every rank must pass the same tensors in the same order (a collective).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from rlsys.sync.shards import aligned


def travel_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """What a tensor is gathered in: `dtype` for floating point (None: its own), its own otherwise."""
    return dtype if dtype is not None and tensor.dtype.is_floating_point else tensor.dtype


def row_sharded_dim(tensor: torch.Tensor) -> int | None:
    """The mesh dimension a DTensor is split along its rows over, if it is split over that one alone
    (FSDP's `Shard(0)`, replicated on any other mesh dimension); None for any other layout."""
    if not isinstance(tensor, DTensor):
        return None
    sharded = [dim for dim, placement in enumerate(tensor.placements) if not placement.is_replicate()]
    if len(sharded) != 1 or type(tensor.placements[sharded[0]]) is not Shard or tensor.placements[sharded[0]].dim != 0:
        return None
    return sharded[0]


@dataclass(frozen=True)
class Packed:
    """One tensor's place in the packed buffer every rank sends: the same on each rank."""

    index: int
    """Its position among the tensors asked for."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    chunk_rows: int
    """Rows each rank holds but the last ones (torch.chunk's split, which `Shard(0)` follows)."""

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    @property
    def slot_bytes(self) -> int:
        """Aligned, so that each tensor's piece views as any dtype."""
        return aligned(self.chunk_rows * self.row_bytes)

    def rows_of(self, rank: int) -> int:
        return max(0, min(self.chunk_rows, self.shape[0] - rank * self.chunk_rows))


def _pack_layout(tensors: list[tuple[int, DTensor]], world: int, dtype: torch.dtype | None) -> tuple[list[Packed], int]:
    layout, start = [], 0
    for index, tensor in tensors:
        packed = Packed(index, travel_dtype(tensor, dtype), tuple(tensor.shape), start, -(-tensor.shape[0] // world))
        layout.append(packed)
        start += packed.slot_bytes
    return layout, start


@torch.no_grad()
def _gather_rows(tensors: list[tuple[int, DTensor]], mesh: DeviceMesh, mesh_dim: int,
                 dtype: torch.dtype | None) -> dict[int, torch.Tensor]:
    """The full tensors of row-sharded `tensors` (all split over `mesh_dim` of `mesh`): one all-gather."""
    world, rank = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    layout, total = _pack_layout(tensors, world, dtype)
    shards = [tensor.to_local() for _, tensor in tensors]
    send = torch.empty(max(total, 1), dtype=torch.uint8, device=shards[0].device)
    for packed, local in zip(layout, shards):
        if local.shape[0] != packed.rows_of(rank):
            raise RuntimeError(f"a shard of {packed.rows_of(rank)} rows was expected on mesh rank {rank}, "
                               f"not {local.shape[0]}: the row split is not torch.chunk's")
        nbytes = packed.rows_of(rank) * packed.row_bytes
        send[packed.start:packed.start + nbytes].view(packed.dtype).copy_(local.reshape(-1))
    received = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(received, send, group=mesh.get_group(mesh_dim))
    full = {}
    for packed in layout:
        pieces = [received[r][packed.start:packed.start + packed.rows_of(r) * packed.row_bytes] for r in range(world)]
        full[packed.index] = torch.cat(pieces).view(packed.dtype).view(packed.shape)
    return full


@torch.no_grad()
def gather_full(tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """The full tensor of each of `tensors`, floating point ones in `dtype` (None: their own): one
    all-gather for those FSDP splits by rows over the same mesh dimension, `full_tensor` for the rest."""
    groups: dict[tuple[DeviceMesh, int], list[tuple[int, DTensor]]] = {}
    for index, tensor in enumerate(tensors):
        mesh_dim = row_sharded_dim(tensor)
        if mesh_dim is not None:
            groups.setdefault((tensor.device_mesh, mesh_dim), []).append((index, tensor))
    full: dict[int, torch.Tensor] = {}
    for (mesh, mesh_dim), members in groups.items():  # in the order met: the same on every rank
        full.update(_gather_rows(members, mesh, mesh_dim, dtype))
    for index, tensor in enumerate(tensors):
        if index not in full:
            cast = tensor.to(travel_dtype(tensor, dtype))
            full[index] = cast.full_tensor() if isinstance(cast, DTensor) else cast
    return [full[index] for index in range(len(tensors))]
