"""Expert parallel, and tensor parallel around the MoE blocks (`rlsys.parallel.moe_block`).

The experts live on a sparse mesh over the same ranks as the dense one, as in torchtitan:
(pp, dp_replicate, efsdp, ep) beside (pp, dp_replicate, dp_shard, cp, tp), with
efsdp = dp_shard x cp x tp / ep (`ParallelDims.expert_mesh`). Each ep group of consecutive
ranks splits every MoE layer's experts (DTensors, Shard(0) by expert); FSDP2 then shards them
over efsdp (`rlsys.parallel.fsdp`). Every rank of dp_shard x cp x tp holds different tokens
in the MoE blocks (tensor-parallel ranks split the sequence there), so the experts' gradients
are the sum over both meshes' axes, which the all-to-all and FSDP make.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import PrepareModuleInputOutput, parallelize_module

from rlsys.parallel.moe_block import MoEBlock, moe_blocks


def apply_moe_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Each tensor-parallel rank runs the MoE blocks on its share of the sequence: the block's
    input is split along the sequence (already so under sequence parallel) and its output put
    back as the residual stream is laid out; the router and a shared expert are replicated."""
    residual = Shard(1) if sequence_parallel else Replicate()
    style = PrepareModuleInputOutput(input_layouts=(residual,), desired_input_layouts=(Shard(1),),
                                     use_local_input=True, output_layouts=(Shard(1),),
                                     desired_output_layouts=(residual,), use_local_output=True)
    for block in moe_blocks(model):
        parallelize_module(block, tp_mesh, style)
        for module in (block.gate, block.shared_expert, block.shared_expert_gate):
            if module is not None:
                distribute_module(module, tp_mesh)  # parameters replicated as DTensors
        block.tp_split = (tp_mesh.get_local_rank(), tp_mesh.size())


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Split every MoE layer's experts over `ep_mesh` by expert; tokens then travel to them."""
    for block in moe_blocks(model):
        _split_experts(block, ep_mesh)


def _split_experts(block: MoEBlock, ep_mesh: DeviceMesh) -> None:
    experts = block.experts
    for name in ("gate_up_proj", "down_proj"):
        param = getattr(experts, name)
        setattr(experts, name, nn.Parameter(distribute_tensor(param.data, ep_mesh, [Shard(0)]),
                                            requires_grad=param.requires_grad))
    experts.ep_group = ep_mesh.get_group()
