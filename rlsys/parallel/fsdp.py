"""FSDP2: shard each decoder block, then the root."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard

from rlsys.parallel.moe_block import GroupedExperts


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype | None,
               reshard_after_forward: bool = True, expert_mesh: DeviceMesh | None = None,
               offload: bool = False) -> nn.Module:
    """Shard `model` in place over `mesh`.

    Gradients are reduced as a plain SUM with no division: the loss is
    already divided by the global number of target tokens, so the summed
    gradient is exactly the single-process gradient. Forcing SUM also keeps
    FSDP2 off AVG and PREMUL_SUM, which gloo gets wrong or rejects (pytorch
    issue 162338).

    On a mesh of one rank nothing is sharded, so the root is the only unit: a unit per block
    would only add a copy-in, a cast and a reduction per block and step, which leaves a
    small model's forward/backward on a GPU bound by kernel launches. The cost is the whole
    model's bf16 copy living through the step instead of one block's.

    An MoE model's experts are units of their own over `expert_mesh` (efsdp, `ParallelDims`),
    sharded along their rows: under expert parallel their first dimension is split over ep.

    With `offload` every unit's shards live in host memory (pinned where there is a GPU) and its
    gradients return there: the model's parameters must be materialized on the CPU.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()
    for experts in expert_groups(model) if expert_mesh is not None else []:
        fully_shard(experts, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                    shard_placement_fn=lambda param: Shard(1), offload_policy=policy)
    for block in decoder_blocks(model) if mesh.size() > 1 or offload else []:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, offload_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, offload_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def expert_groups(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if isinstance(module, GroupedExperts)]


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks, found by the class names HF lists in `_no_split_modules`."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"{type(model).__name__}: no decoder blocks found to shard (_no_split_modules={names})")
    return blocks
