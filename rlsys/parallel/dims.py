"""ParallelDims: the parallel layout of the training group and its DeviceMesh."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ParallelDims:
    """Ranks are laid out row-major over (dp_replicate, dp_shard).

    dp_shard ranks split every parameter (FSDP2); dp_replicate groups hold
    replicas of the sharded model (HSDP). Every rank is a data-parallel rank.
    """

    dp_replicate: int = 1
    dp_shard: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_size(self) -> int:
        return self.world_size

    def dp_rank(self, rank: int) -> int:
        return rank

    def build_mesh(self, device_type: str) -> DeviceMesh:
        return init_device_mesh(
            device_type, (self.dp_replicate, self.dp_shard), mesh_dim_names=("dp_replicate", "dp_shard")
        )

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """1-D mesh for plain FSDP, 2-D (replicate, shard) for HSDP."""
        if self.dp_replicate > 1:
            return mesh["dp_replicate", "dp_shard"]
        return mesh["dp_shard"]
