"""ParallelDims: the parallel layout of the training group and its DeviceMesh.

Ranks are laid out row-major over (pp, dp_replicate, dp_shard, cp, tp), the
order torchtitan uses: tensor-parallel peers are neighbours (the most
traffic, on one node), pipeline stages are the outermost split. MoE experts live on a
second, sparse mesh over the same ranks, (pp, dp_replicate, efsdp, ep), expert-parallel
peers the neighbours (`rlsys.parallel.expert_parallel`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from transformers import PretrainedConfig

from rlsys.config.layout import ParallelConfig
from rlsys.models.moe import num_experts

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EXPERT_MESH_DIMS = ("pp", "dp_replicate", "efsdp", "ep")


class LayoutError(ValueError):
    """Degrees that the world or the model cannot take; the message starts with the config key."""


@dataclass(frozen=True)
class Coordinates:
    """Where one rank sits in the layout."""

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    dp_rank: int
    """Which shard of a data-parallel batch this rank consumes (the same for all its tp/cp/pp peers)."""
    collected: bool
    """Whether the driver gathers this rank's outputs: tp rank 0, cp rank 0, last pipeline stage."""
    leads_stage: bool
    """The first rank of its pipeline stage: it writes and sends the stage's full weights."""


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp_replicate: int = 1
    """Replica groups of the sharded model (HSDP when dp_shard > 1 too)."""
    dp_shard: int = 1
    """Ranks that split every parameter (FSDP2)."""
    cp: int = 1
    tp: int = 1
    ep: int = 1
    """Ranks that split each MoE layer's experts, out of dp_shard x cp x tp (not a dimension of its own)."""

    @classmethod
    def of(cls, parallel: ParallelConfig) -> ParallelDims:
        """The layout of a `parallel:` config section."""
        return cls(**{name: getattr(parallel, name) for name in (*MESH_DIMS, "ep")})

    def __post_init__(self):
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise LayoutError(f"parallel.{f.name}: must be >= 1, got {getattr(self, f.name)}")
        token_ranks = self.dp_shard * self.cp * self.tp
        if token_ranks % self.ep:
            raise LayoutError(f"parallel.ep: {self.ep} does not divide dp_shard x cp x tp = {token_ranks}, "
                              f"the ranks the experts are split over")

    @property
    def efsdp(self) -> int:
        """Ranks that FSDP-shard each expert: dp_shard x cp x tp / ep."""
        return self.dp_shard * self.cp * self.tp // self.ep

    @property
    def degrees(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in MESH_DIMS)

    @property
    def world_size(self) -> int:
        size = 1
        for degree in self.degrees:
            size *= degree
        return size

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    def coordinates(self, rank: int) -> Coordinates:
        coords, rest = {}, rank
        for name, degree in reversed(list(zip(MESH_DIMS, self.degrees))):
            coords[name], rest = rest % degree, rest // degree
        return Coordinates(**coords, dp_rank=coords["dp_replicate"] * self.dp_shard + coords["dp_shard"],
                           collected=coords["tp"] == 0 and coords["cp"] == 0 and coords["pp"] == self.pp - 1,
                           leads_stage=rank % self.ranks_per_stage == 0)

    @property
    def ranks_per_stage(self) -> int:
        return self.world_size // self.pp

    def stage_ranks(self) -> list[range]:
        """The ranks of each pipeline stage, in stage order (pp is the outermost dimension);
        the first of each leads it."""
        size = self.ranks_per_stage
        return [range(stage * size, (stage + 1) * size) for stage in range(self.pp)]

    def check_model(self, model_config: PretrainedConfig, stages_per_rank: int = 1) -> None:
        """Degrees the model can take: tp splits heads, KV heads and the MLP evenly (the
        vocabulary may split unevenly: DTensor gives the first ranks one row more);
        pp needs untied embeddings and a decoder layer per stage."""
        if self.tp > 1:
            heads, kv_heads = model_config.num_attention_heads, model_config.num_key_value_heads
            for what, size in (("attention heads", heads), ("key/value heads", kv_heads),
                               ("intermediate size", model_config.intermediate_size)):
                if size % self.tp:
                    raise LayoutError(f"parallel.tp: {self.tp} does not divide the model's {what} ({size})")
        if self.cp > 1:
            heads, kv_heads = model_config.num_attention_heads, model_config.num_key_value_heads
            for what, size in (("attention heads", heads), ("key/value heads", kv_heads)):
                if size % (self.tp * self.cp):
                    raise LayoutError(f"parallel.cp: tp x cp = {self.tp * self.cp} does not divide the model's "
                                      f"{what} ({size}): context parallel attention splits each rank's heads")
        if self.pp > 1 and getattr(model_config, "tie_word_embeddings", False):
            raise LayoutError("parallel.pp: the model ties its input and output embeddings, which live on the first "
                              "and the last pipeline stage; use an untied model")
        experts = num_experts(model_config)
        if self.ep > 1 and not experts:
            raise LayoutError(f"parallel.ep: {self.ep} expert-parallel ranks for a model without experts "
                              f"({model_config.model_type})")
        if experts % self.ep:
            raise LayoutError(f"parallel.ep: {self.ep} does not divide the model's {experts} experts")
        stages, layers = self.pp * stages_per_rank, model_config.num_hidden_layers
        if stages > layers:
            raise LayoutError(f"parallel.pp: {stages} pipeline stages for {layers} decoder layers")

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """One mesh over every dimension (degree-1 ones included, so names always resolve),
        with the flattened data-parallel views FSDP and the batch split use."""
        mesh = init_device_mesh(device_type, self.degrees, mesh_dim_names=MESH_DIMS)
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        mesh["dp_replicate", "dp_shard", "cp", "tp"]._flatten("token_ranks")
        return mesh

    @staticmethod
    def forget_meshes() -> None:
        """After the process group is gone, before a process builds the meshes of another group: DTensor
        caches what it derived from a mesh (sharding propagation, redistribution plans) keyed by the
        mesh's value, its shape, names and ranks, so an equal mesh of the next group would be handed the
        old mesh and its destroyed process groups. (Each cache is looked up by name: a torch without one
        has nothing to clear.)"""
        from torch.distributed.tensor import _collective_utils, _redistribute, _sharding_prop, debug

        caches = [getattr(debug, "_clear_sharding_prop_cache", None),
                  getattr(_redistribute, "clear_redistribute_planner_cache", None),
                  getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None),
                  getattr(getattr(_collective_utils.MeshTopoInfo, "build_from_mesh", None), "cache_clear", None),
                  getattr(getattr(_sharding_prop.ShardingPropagator, "_propagate_tensor_meta_cached", None),
                          "cache_clear", None)]
        for clear in caches:
            if clear is not None:
                clear()

    def expert_mesh(self, device_type: str) -> DeviceMesh:
        """The sparse mesh over the same ranks: (pp, dp_replicate, efsdp, ep), ep peers neighbours.
        A mesh of its own: only the experts live on it, no DTensor mixes the two."""
        degrees = (self.pp, self.dp_replicate, self.efsdp, self.ep)
        return init_device_mesh(device_type, degrees, mesh_dim_names=EXPERT_MESH_DIMS)

    def expert_fsdp_mesh(self, expert_mesh: DeviceMesh) -> DeviceMesh:
        """Experts are sharded over efsdp, replicated over dp_replicate."""
        if self.dp_replicate > 1:
            return expert_mesh["dp_replicate", "efsdp"]
        return expert_mesh["efsdp"]

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """Parameters are sharded over dp_shard x cp (context-parallel ranks hold the same
        weights), replicated over dp_replicate: a 2-D mesh for HSDP, else 1-D."""
        if self.dp_replicate > 1:
            return mesh["dp_replicate", "dp_shard_cp"]
        return mesh["dp_shard_cp"]
