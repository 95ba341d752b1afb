"""A rank's parameters as the weight sync and the export read them: full sizes and tensors under
HF names, this rank's own shards (with LoRA adapters merged in), and handles to those shards for
an engine on the same machine to read in place. It takes the model's parts, not the rank's `RankModel`."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from rlsys.config.model import LoraConfig
from rlsys.models import lora
from rlsys.sync.bucket_gather import gather_full
from rlsys.sync.shards import Shared, share

Shard = tuple[str, torch.Tensor, tuple, tuple]
"""(HF name, this rank's shard, the full shape, the shard's offset in the full tensor)."""


class RankWeights:
    def __init__(self, parts: list[nn.Module], lora_cfg: LoraConfig):
        self.parts = parts
        self.fsdp_parts = [part for part in parts if isinstance(part, FSDPModule)]
        self.lora_cfg = lora_cfg
        self.shard_offsets: dict[str, tuple[int, ...] | None] = {}
        self.shared_storages: dict[str, int] = {}
        """Address of each shared shard's storage (`share_shards`): an engine reads it in place."""

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters under their HF names (stages never share a name); with LoRA, the
        names of the wrapped model (`rlsys.models.lora`)."""
        for part in self.parts:
            yield from part.named_parameters()

    def parameter_nbytes(self) -> dict[str, int]:
        """Full (unsharded) size of each of this rank's parameters, by HF name, in module order."""
        return {name: p.numel() * p.element_size() for name, p in self.named_parameters()}

    def full_tensors(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors of `names`, gathered from every mesh axis but pp (a collective
        over the ranks of this pipeline stage: each iterates in the same order)."""
        self._reshard()
        params = dict(self.named_parameters())
        for name in names:
            yield name, full_tensor(params[name]).detach()

    def bucket_tensors(self, names: list[str], dtype: torch.dtype | None) -> list[tuple[str, torch.Tensor]]:
        """HF-named full tensors of `names`, floating point ones in `dtype` (None: their own), gathered
        at once (`rlsys.sync.bucket_gather`: one collective for FSDP's row shards) over the ranks
        of this pipeline stage, each of which calls this with the same names."""
        self._reshard()
        params = dict(self.named_parameters())
        return list(zip(names, gather_full([params[name] for name in names], dtype)))

    @torch.no_grad()
    def local_shards(self, names: list[str]) -> list[Shard]:
        """This rank's shard of each of `names`: no collective. A rank holding a replica of a shard
        (a Replicate placement at a coordinate other than 0: another data-parallel replica, a
        tensor-parallel peer's copy of a norm) yields nothing for it, so each element is sent once.
        (Without grad mode `to_local` needs no `detach`, whose dispatch through DTensor is most of
        the cost here.)"""
        self._reshard()
        params = dict(self.named_parameters())
        shards = []
        for name in names:
            param = params[name]
            if name not in self.shard_offsets:  # fixed by the layout: worked out on the first sync
                self.shard_offsets[name] = shard_offset(param)
            if self.shard_offsets[name] is not None:
                shards.append((name, local_tensor(param), tuple(param.shape), self.shard_offsets[name]))
        return shards

    def merged_nbytes(self) -> dict[str, int]:
        """`parameter_nbytes` of a LoRA model with its adapters merged: the base layers' HF names."""
        return {lora.base_name(name): nbytes for name, nbytes in self.parameter_nbytes().items()
                if not lora.is_adapter(name)}

    @torch.no_grad()
    def merged_shards(self, names: list[str]) -> list[Shard]:
        """`local_shards` of the merged weights `names` (HF names): this rank's rows of each adapted
        layer's W + alpha / rank * B @ A, from its own rows of W and B (FSDP2 splits both along their
        output rows alike) and the whole of A, gathered: a collective over the ranks of the stage."""
        self._reshard()
        params = dict(self.named_parameters())
        wrapped = {lora.base_name(name): name for name in params if not lora.is_adapter(name)}
        shards = []
        for name in names:
            param = params[wrapped[name]]
            shard = local_tensor(param)
            layer = lora.adapted_layer(wrapped[name])
            if layer is not None:
                a_name, b_name = lora.adapter_names(layer)
                shard = lora.merge(shard, full_tensor(params[a_name]), local_tensor(params[b_name]), self.lora_cfg)
            offset = shard_offset(param)
            if offset is not None:
                shards.append((name, shard, tuple(param.shape), offset))
        return shards

    def adapter_names(self) -> list[str]:
        """The names of this rank's LoRA adapter weights."""
        return [name for name, _ in self.named_parameters() if lora.is_adapter(name)]

    def share_shards(self, names: list[str]) -> list[Shared]:
        """Handles to the `local_shards` of `names` for an engine on this machine to read in place
        on every sync: moved into shared memory on CPU, where they are on a GPU (`rlsys.sync.shards.share`)."""
        shards = self.local_shards(names)
        shared = share(shards)
        self.shared_storages.update((name, local.untyped_storage().data_ptr()) for name, local, _, _ in shards)
        return shared

    def check_shared(self) -> None:
        """An engine reading a shard in place would go on reading a storage the parameter left."""
        if not self.shared_storages:
            return
        params = dict(self.named_parameters())
        for name, address in self.shared_storages.items():
            if local_tensor(params[name]).untyped_storage().data_ptr() != address:
                raise RuntimeError(f"{name}: its shard moved out of the shared memory the rollout engines read")

    def _reshard(self) -> None:
        for part in self.fsdp_parts:
            part.reshard()


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter or gradient: a DTensor's local shard, else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of a parameter or gradient (a collective for a DTensor)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def shard_offset(param: torch.Tensor) -> tuple[int, ...] | None:
    """Where this rank's shard of `param` starts in the full tensor; None for a replica that
    another rank sends."""
    if not isinstance(param, DTensor):  # one rank without FSDP holds it whole
        return (0,) * param.dim()
    coordinate = param.device_mesh.get_coordinate()
    if any(c and placement.is_replicate() for c, placement in zip(coordinate, param.placements)):
        return None
    return tuple(compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)[1])
